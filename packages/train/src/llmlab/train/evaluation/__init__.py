"""Evaluation with lm-evaluation-harness: llmlab models as an lm-eval ``LM``
(:mod:`~llmlab.train.evaluation.lm`), llmlab's own tasks defined by local files
(``tasks/``), and the runner behind ``python -m llmlab.train.eval`` and the end-of-training
callback (:mod:`~llmlab.train.evaluation.run`)."""
