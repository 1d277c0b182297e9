#!/usr/bin/env bash
# An AVX2-only x86 CPU on any Linux x86 host, for correctness checks: a QEMU guest (TCG, QEMU's
# EPYC-Milan model: AVX2 + FMA + F16C, no AVX-512, no AMX) that sees this host's root file system
# over 9p and runs one shell script in it. cpuid, /proc/cpuinfo, XCR0 and the compiler's
# -march=native all say AVX2 there, so the kernels build as on such a CPU and torch, oneDNN and MKL
# take their AVX2 paths by detection, not by a cap. Emulated: tens of times slower than the host,
# so its times say nothing about speed (use RADIXSERVE_CPU_ISA=avx2 on the host for figures, and a
# real AVX2 machine for claims).
#
#   benchmarks/avx2_guest.sh setup            # once, as root: Debian packages + the initramfs
#   benchmarks/avx2_guest.sh run JOB.sh [LOG] # boot, run `sh JOB.sh` in the current folder, power off
#
# Environment: AVX2_GUEST_DIR (default /var/tmp/radixserve-avx2-guest), AVX2_GUEST_MEM (default 12G),
# AVX2_GUEST_CPU (default EPYC-Milan), AVX2_GUEST_TIMEOUT seconds (default 7200).
# In the guest: 2 vCPUs, the host's PATH and HOME, a tmpfs /tmp of its own (Unix sockets do not
# work over 9p), so the job, its log and the guest folder live outside /tmp; files written
# anywhere else land on the host. Why TCG and not KVM: a host that is itself a VM may lack usable nested KVM.
set -euo pipefail
DIR=${AVX2_GUEST_DIR:-/var/tmp/radixserve-avx2-guest}
MODS="virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci 9pnet 9pnet_virtio netfs fscache 9p"

kernel() { ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1; }

setup() {
    if [ -z "$(kernel)" ] || ! command -v qemu-system-x86_64 >/dev/null || [ ! -x /bin/busybox ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-system-x86 linux-image-amd64 busybox-static
    fi
    local kver root
    kver=$(basename "$(kernel)" | sed 's/^vmlinuz-//')
    root=$DIR/initramfs
    rm -rf "$root" && mkdir -p "$root"/{bin,mods,proc,sys,dev,newroot}
    cp /bin/busybox "$root/bin/busybox"
    for m in $MODS; do
        f=$(find "/lib/modules/$kver" -name "$m.ko*" | head -1)
        [ -n "$f" ] || { echo "module $m not found for kernel $kver" >&2; exit 1; }
        case $f in
            *.xz) xz -dc "$f" > "$root/mods/$m.ko" ;;
            *.zst) zstd -dcq "$f" > "$root/mods/$m.ko" ;;
            *) cp "$f" "$root/mods/$m.ko" ;;
        esac
    done
    cat > "$root/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $MODS; do insmod /mods/\$m.ko 2>/dev/null || true; done
mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=1048576 hostroot /newroot || { echo "9p mount failed"; poweroff -f; }
exec switch_root /newroot /bin/sh $DIR/guest-init.sh
EOF
    chmod +x "$root/init"
    cp /bin/busybox "$DIR/busybox"
    cat > "$DIR/guest-init.sh" <<EOF
#!/bin/sh
# PID 1 in the guest, on the host's root: a minimal system, the job, power off.
export PATH="\$GUEST_PATH" HOME="\$GUEST_HOME"
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs -o size=8g tmpfs /tmp
mkdir -p /dev/shm /dev/pts && mount -t tmpfs tmpfs /dev/shm && mount -t devpts devpts /dev/pts
$DIR/busybox ip link set lo up
cd "\$GUEST_CWD"
{ echo "=== guest: \$(grep -m1 'model name' /proc/cpuinfo)"; sh "\$GUEST_JOB"; echo "=== job rc=\$?"; } > "\$GUEST_LOG" 2>&1
sync
$DIR/busybox poweroff -f
EOF
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$DIR/initramfs.cpio.gz"
    echo "guest ready in $DIR (kernel $kver)"
}

run() {
    local job log
    job=$(realpath "$1")
    log=$(realpath -m "${2:-$DIR/job.log}")
    [ -f "$DIR/initramfs.cpio.gz" ] || { echo "run '$0 setup' first" >&2; exit 1; }
    for p in "$job" "$log" "$DIR" "$PWD"; do
        case $p in /tmp|/tmp/*) echo "$p is under /tmp, which the guest replaces with its own tmpfs" >&2; exit 2 ;; esac
    done
    : > "$log"
    timeout "${AVX2_GUEST_TIMEOUT:-7200}" qemu-system-x86_64 -accel tcg,thread=multi \
        -m "${AVX2_GUEST_MEM:-12G}" -smp 2 -cpu "${AVX2_GUEST_CPU:-EPYC-Milan}" \
        -kernel "$(kernel)" -initrd "$DIR/initramfs.cpio.gz" \
        -append "console=ttyS0 panic=-1 quiet GUEST_JOB=$job GUEST_LOG=$log GUEST_CWD=$PWD GUEST_PATH=$PATH GUEST_HOME=$HOME" \
        -virtfs local,path=/,mount_tag=hostroot,security_model=passthrough,id=hostroot,multidevs=remap \
        -nographic -no-reboot -monitor none > "$DIR/console.log" 2>&1 || true
    cat "$log"
    grep -q "^=== job rc=0$" "$log"
}

case "${1:-}" in
    setup) setup ;;
    run) shift; [ $# -ge 1 ] || { echo "usage: $0 run JOB.sh [LOG]" >&2; exit 2; }; run "$@" ;;
    *) echo "usage: $0 setup | run JOB.sh [LOG]" >&2; exit 2 ;;
esac
