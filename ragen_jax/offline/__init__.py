"""Offline tools: they read what a run wrote (or build a test asset), and never run inside training.

    ragen-eval-analysis RUN/eval/transcripts_step60.jsonl     # where validation episodes fail
    ragen-gradient-report RUN                                 # gradient norms by reward-spread bucket
    ragen-build-tiny-tokenizer [--out DIR]                    # the tiny preset's tokenizer

Each is also ``python -m ragen_jax.offline.<name>``.
"""
