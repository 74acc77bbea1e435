"""BlockBatch, Fast-dLLM and vanilla decoding as a transformers Hub ``custom_generate``.

Upload this folder to a model repository (or point ``custom_generate`` at a checkout of
hf-blockbatch) and call, on a masked-diffusion model that implements hf-blockbatch's forward
contract::

    model.generate(input_ids, generation_config=hf_blockbatch.BlockBatchConfig(),
                   custom_generate="<repo or path>", trust_remote_code=True)

The decoding itself lives in the installed ``hf_blockbatch`` package (see requirements.txt).
"""

from hf_blockbatch import custom_generate as generate

__all__ = ["generate"]
