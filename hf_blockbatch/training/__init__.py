"""Training of the tiny checkpoints shipped in ``hf_blockbatch/assets`` (``tiny-llada``, ``tiny-dream``).

No weights can be downloaded where this project is built and tested, so it trains its own:
:mod:`~hf_blockbatch.training.tokenizer` (byte-level BPE), :mod:`~hf_blockbatch.training.sft`
(training on the synthetic suites), :mod:`~hf_blockbatch.training.objective` (LLaDA's SFT
objective: noising and loss, shared with the checks) and :mod:`~hf_blockbatch.training.eval_quick`
(held-out checks used to keep the best checkpoint). Submodules are imported on use, so
importing the package stays cheap.
"""
