"""A test-only model family: two blocks of a different kind (GPT-J's parallel block: attention and feed-forward
both read one norm of the input) and its own Hugging Face layout. It proves that a family is this folder plus one
``register(SPEC)`` call: it trains, resumes and converts through the same paths as Llama (test_toy_family.py)."""

from loom.models.spec import ModelSpec
from tests.unit.toy_family.hf import ToyHF
from tests.unit.toy_family.model import FLAVORS, Toy, ToyArgs

SPEC = ModelSpec("toy", ToyArgs, Toy, FLAVORS, ToyHF())
