"""The training job's pieces (torchtitan's ``components/`` layout): ``config`` (typed TOML
config), ``data`` (corpus, tokenizer, the position-indexed sequence stream), ``model`` (the HF
Llama, optimizer, schedule), ``parallelize`` (the (dp, tp) mesh, tensor/sequence parallelism,
FSDP2, grad clipping), ``loss`` (the two heads), ``checkpoint`` (DCP) and ``metrics`` (logging,
losses file). Nothing here has import-time side effects or global process groups."""
