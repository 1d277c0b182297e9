# The checks benchmarks/avx2_guest.sh runs in its AVX2-only guest (from the repository root):
#   benchmarks/avx2_guest.sh run benchmarks/avx2_guest_job.sh /var/tmp/avx2-guest.log
# What the CPU is, which paths the kernels have, the capital-of-France answer in each --dtype,
# then the tests of every CPU path (kernels against eager, every level and dtype end to end
# on the real SmolLM2). AVX2_GUEST_TESTS replaces the test list ("none" skips them).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/var/tmp/radixserve-avx2-guest/cache}
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' '; echo
python -c "import torch; print('torch', torch.__version__, 'ATen capability', torch.backends.cpu.get_cpu_capability())"
python -m radixserve.model.kernels || exit 1
for dt in auto float32 bfloat16; do
    t0=$(date +%s)
    out=$(radixserve generate "What is the capital of France?" --dtype $dt --max-tokens 12 2>&1 | tail -1)
    echo "generate --dtype $dt ($(( $(date +%s) - t0 )) s): $out"
    case $out in *Paris*) ;; *) fail=1 ;; esac
done
tests=${AVX2_GUEST_TESTS:-tests/test_cpu_paths.py tests/test_kernels_ops.py tests/test_attention_fused.py}
if [ "$tests" != none ]; then
    python -m pytest -q -p no:cacheprovider $tests -rs > /tmp/guest-pytest.log 2>&1
    rc=$?
    tail -25 /tmp/guest-pytest.log
    [ $rc = 0 ] || fail=1
fi
exit ${fail:-0}
