from loom.models.llama.flavors import FLAVORS, LlamaArgs, round_vocab
from loom.models.llama.model import Block, Llama

__all__ = ["FLAVORS", "Block", "Llama", "LlamaArgs", "round_vocab"]
