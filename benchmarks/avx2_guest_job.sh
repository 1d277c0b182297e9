# The checks benchmarks/avx2_guest.sh runs in its AVX2-only guest (from the repository root):
#   benchmarks/avx2_guest.sh run benchmarks/avx2_guest_job.sh /var/tmp/avx2-guest.log
# What the CPU is, which paths the kernels have, and the capital-of-France answer in each
# --dtype. For tests in the guest, write a job that runs them (the guest sees this folder).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/var/tmp/radixserve-avx2-guest/cache}
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' '; echo
python -c "import torch; print('torch', torch.__version__, 'ATen capability', torch.backends.cpu.get_cpu_capability())"
python -m radixserve.kernels.library || exit 1
python benchmarks/avx2_guest_paris.py || fail=1
exit ${fail:-0}
