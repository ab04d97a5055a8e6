"""qfuse's benchmarks, one script per question, run as modules from the repository root:

    python -m bench.models.bench_models --models minilm-l6 --batches 1,32
    python -m bench.kernels.bench_linear --out /tmp/linear.json
    python -m bench.tune.tune_qgemm --out tuning.json
    python -m bench.diag.diag_host --model bert-base

``models/`` whole models, ``kernels/`` single kernels against cuBLAS/cuDNN/torch, ``tune/``
schedule search and cost models, ``diag/`` diagnostics behind a number. Shared pieces:
``bench.harness`` (timing, checks, the result file), ``bench.baselines`` (what a user has without
qfuse), ``bench.warm`` (parallel precompilation). README.md lists every script.

Nothing is imported here: ``python -m bench.tables`` stays free of torch.
"""
