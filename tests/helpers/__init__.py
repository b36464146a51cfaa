"""What many test files share, written once.

* :mod:`.distributed`: ``run_distributed`` (re-exported from ``llmlab.parallel.launch``): run a
  plain function on N gloo ranks on localhost and get each rank's result or its traceback.
* :mod:`.tiny`: the tiny GPT (config, model, token batches, ``lm_loss``), a tiny
  ``CausalLMTask`` and data module, ``loss_recorder``, and the ``quiet_trainer`` /
  ``rank_trainer`` factories.
* :mod:`.runs`: ``make train`` as a subprocess, and reading back what a run wrote (W&B offline).

Test modules import from here (or from a non-test module next to them), never from another
``test_*.py`` (``tests/test_import_boundaries.py``).
"""
