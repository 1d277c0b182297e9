# The kernel-path tests in benchmarks/avx2_guest.sh's AVX2-only guest (from the repository root):
#   benchmarks/avx2_guest.sh run benchmarks/avx2_guest_tests.sh /var/tmp/avx2-guest-tests.log
# Every path x dtype against the eager reference, and the capped builds, on a CPU that lacks
# AVX-512 by detection (no RADIXSERVE_CPU_ISA): a skip must name a path this CPU lacks.
# Emulated, so the whole suite is too slow here; these files are the ones that ask the CPU.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/var/tmp/radixserve-avx2-guest/cache}
unset RADIXSERVE_CPU_ISA
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' '; echo
python -m pytest -q -p no:cacheprovider -rs tests/test_cpu_paths.py tests/test_kernels_ops.py \
    tests/test_attention_fused.py tests/test_attention_split.py tests/test_kv_quant.py
