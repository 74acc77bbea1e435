"""BlockBatch's own mechanisms: merging between branches and leader sync (refresh and stop are
shared with Fast-dLLM and live one level up)."""

from hf_blockbatch.generation.blockbatch.merge import merge
from hf_blockbatch.generation.blockbatch.sync import leaders, sync_to_leader

__all__ = ["leaders", "merge", "sync_to_leader"]
