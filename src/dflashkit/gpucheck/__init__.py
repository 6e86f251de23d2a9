"""The GPU check (`dflashkit gpu-check`): the CUDA paths no CPU test reaches, in a few time-boxed checks.

Usage:
    PYTHONPATH=src python3 -m dflashkit gpu-check OUT_DIR        # on a CUDA machine, nothing installed
    summary = run_gpu_check(Path(OUT_DIR))                        # the same from Python
    summary = run_gpu_check(tmp, device="cpu", isolate=False)     # the checks' CPU halves (make test)

Checks (runner.CHECKS, in order; each in its own process and time box, the whole run under 8 minutes):
    flex         train_checks.flex_vs_sdpa       drafter.attention=flex ≡ sdpa: loss + gradients, tiny and
                                                 medium drafter, float32 and bf16 (and flex + train.compile)
    bf16-8b      train_checks.bf16_steps         bf16 steps on a random Qwen3-8B-shaped target with online
                                                 features, 1- and 5-layer drafter: tokens/s, step time, memory
    cpu-gpu      train_checks.cpu_equals_gpu     `fit` on the tiny target in float32: CPU ≡ GPU
    decode       decode_check.decoder_equals_baseline   SpecDecoder's greedy output ≡ block size 1, τ, step times
    distributed  dist_check.one_equals_two_processes    1 ≡ 2 ranks of `dflashkit train`

    runner.py      orchestration, time boxes, child processes, summary.json + gpu-check.log, exit status
    compare.py     the comparisons and their tolerances (why each is what it is)
    fixtures.py    shapes (QWEN3_8B, MEDIUM, SMALL), random targets built in memory, tiny run dirs
Importing this package does not import torch (the checks do, in their own processes).
"""

from dflashkit.gpucheck.runner import CHECKS, NO_CUDA, CheckContext, run_gpu_check  # noqa: F401
