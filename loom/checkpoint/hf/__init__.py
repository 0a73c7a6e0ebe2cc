"""Hugging Face folders <-> loom, by job: ``config`` (config.json <-> model args, through each family's adapter in
loom.models), ``names`` (tensor names), ``reader`` (sharded safetensors into a possibly sharded model), ``head``
(a reward model's score head), ``export`` (a folder transformers loads), ``tokenizer`` (the tokenizer files an
export writes), ``dcp_import`` (a folder as a loom DCP checkpoint, which ``model.init_from`` accepts too)."""
