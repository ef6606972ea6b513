"""Capture the ``trained`` data mode's fixture: final hidden states, lm_head and next-token targets
of a Llama that was actually trained, for ``benchmarks/data.py`` (``make_inputs(mode="trained",
fixture=PATH)``, ``bench.py --data trained --fixture PATH``).

Two sources:

1. Train here (no launcher needed): a ``transformers.LlamaForCausalLM`` from a training config's
   ``[model]`` section (default ``configs/train/llama_small_gpu.toml`` on CUDA: H=1024, 6 layers),
   with the tokenizer's own vocabulary (a byte-level BPE of ``--vocab`` trained on CPython's
   ``pydoc_data.topics``, the same corpus and tokenizer recipe as ``launch/``), AdamW, bf16
   autocast on CUDA, ``--steps`` steps on random windows of the corpus:

       python benchmarks/capture_trained.py --steps 300                      # CUDA, ~1 min
       python benchmarks/capture_trained.py --device cpu --config configs/train/tiny_cpu.toml --steps 200

2. A checkpoint of ``launch/train.py`` written with torch.distributed.checkpoint (DCP):
   ``--checkpoint <out_dir>/checkpoints/step_<N>``. The DCP folder is converted to one state dict
   (``dcp_to_torch_save``, no process group needed), the LlamaForCausalLM keys are found by the
   suffix ``lm_head.weight`` (any prefix such as ``model.`` or ``app.model.`` is stripped), the
   sizes are read off the weights and the head counts off ``--config``. Token ids: ``--tokens`` (a
   ``.pt`` holding ``{"ids": ...}`` as the launcher caches them under ``runs/cache``; default: the
   newest ``runs/cache/tokens-*.pt`` whose vocab fits the checkpoint). Checked against a DCP
   folder this script writes itself (``--selftest-dcp``, tests/test_benchmarks.py) and against the
   launcher's own checkpoint of a (dp=2, tp=2) FSDP2 x TP job (tests/test_train.py). On the GPU:
   ``bash benchmarks/device.sh trainedbench`` trains ``configs/train/llama_small_gpu.toml`` with the
   launcher, captures from its last checkpoint and runs ``bench.py --data trained`` (the image has
   transformers and tokenizers).

The fixture (``--out``, default ``benchmarks/fixtures/trained.pt``; ``benchmarks/fixtures/`` is
git-ignored) holds ``hidden [m, H]`` bf16 (the decoder's output after the final norm, i.e. what
the lm_head sees), ``weight [V, H]`` bf16, ``target [m]`` int64 (the next token), ``meta``.
m = ``--rows`` (default 8192, the benchmarks' N; ``make_inputs`` tiles rows if it needs more).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "fixtures" / "trained.pt"


def corpus_ids(vocab: int) -> tuple[torch.Tensor, int]:
    """The pydoc_data.topics corpus as byte-level BPE ids (tokenizer trained here, ~5 s) and the
    tokenizer's vocabulary size."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [topics[k] for k in sorted(topics)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long), tok.get_vocab_size()


def model_section(config: str) -> dict:
    with open(config, "rb") as f:
        return tomllib.load(f).get("model", {})


def build_llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, seq: int,
                rope_theta: float = 500000.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max(seq, 2048),
                      rope_theta=rope_theta, tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


def batches(ids: torch.Tensor, seq: int, batch: int, g: torch.Generator):
    while True:
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])


def train(args, device: torch.device):
    m = model_section(args.config)
    ids, vocab = corpus_ids(args.vocab)
    torch.manual_seed(args.seed)
    model = build_llama(vocab, m.get("hidden_size", 1024), m.get("intermediate_size", 2816), m.get("num_layers", 6),
                        m.get("num_heads", 16), m.get("num_kv_heads", 8), args.seq, m.get("rope_theta", 500000.0))
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    it = batches(ids, args.seq, args.batch, g)
    t0, loss = time.perf_counter(), float("nan")
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / max(1, args.steps // 10)) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for grp in opt.param_groups:
            grp["lr"] = max(lr, args.lr * 0.05)
        b = next(it).to(device)
        with amp:
            out = model(input_ids=b[:, :-1], labels=b[:, :-1].clone())  # HF shifts labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model, ids, dict(source="train", steps=args.steps, final_train_loss=loss, config=args.config, vocab=vocab)


def _flatten(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def from_checkpoint(args, device: torch.device):
    """LlamaForCausalLM weights from a DCP folder (see the module docstring)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(args.checkpoint, f"{tmp}/sd.pt")
        flat = dict(_flatten(torch.load(f"{tmp}/sd.pt", map_location="cpu", weights_only=False)))
    heads = [k for k in flat if k.endswith("lm_head.weight")]
    if len(heads) != 1:
        raise SystemExit(f"{args.checkpoint}: expected one '*lm_head.weight' key, found {heads}; keys: {list(flat)[:20]}")
    prefix = heads[0][: -len("lm_head.weight")]
    sd = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix) and torch.is_tensor(v)}
    sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
    w = sd["lm_head.weight"]
    vocab, hidden = w.shape
    layers = len({k.split(".")[2] for k in sd if k.startswith("model.layers.")})
    inter = sd["model.layers.0.mlp.gate_proj.weight"].shape[0]
    m = model_section(args.config)
    model = build_llama(vocab, hidden, inter, layers, m.get("num_heads", 16), m.get("num_kv_heads", 8), args.seq,
                        m.get("rope_theta", 500000.0))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise SystemExit(f"checkpoint does not match LlamaForCausalLM: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.to(device)
    if args.tokens:
        blob = torch.load(args.tokens, map_location="cpu", weights_only=True)
    else:
        cands = sorted((ROOT / "runs" / "cache").glob("tokens-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
        blob = next((b for b in (torch.load(p, weights_only=True) for p in cands) if int(b["vocab_size"]) <= vocab), None)
        if blob is None:
            raise SystemExit("no runs/cache/tokens-*.pt fits this checkpoint's vocabulary: pass --tokens")
    ids = (blob["ids"] if isinstance(blob, dict) else blob).long()
    if int(ids.max()) >= vocab:
        raise SystemExit(f"token ids reach {int(ids.max())} but the checkpoint's vocabulary is {vocab}")
    return model, ids, dict(source="checkpoint", checkpoint=str(args.checkpoint), config=args.config, vocab=vocab)


@torch.no_grad()
def capture(model, ids: torch.Tensor, rows: int, seq: int, device: torch.device, seed: int) -> dict:
    """``rows`` (hidden after the final norm, next token) pairs from held-out-order windows."""
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    per = seq
    nseq = -(-rows // per)
    it = batches(ids, seq, nseq, g)
    b = next(it).to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    hs = []
    for i in range(0, nseq, 8):
        with amp:
            hs.append(model.model(input_ids=b[i:i + 8, :-1]).last_hidden_state.float())
    hid = torch.cat(hs).reshape(-1, hs[0].shape[-1])[:rows]
    tgt = b[:, 1:].reshape(-1)[:rows]
    w = model.lm_head.weight.detach()
    loss = torch.nn.functional.cross_entropy(hid @ w.float().T, tgt).item()
    return dict(hidden=hid.to(torch.bfloat16).cpu(), weight=w.to(torch.bfloat16).cpu(), target=tgt.cpu(),
                meta=dict(capture_loss=loss))


def selftest_dcp(path: Path) -> None:
    """Write a tiny LlamaForCausalLM as a DCP folder ({"model": state_dict}) to check --checkpoint."""
    import torch.distributed.checkpoint as dcp

    ids, vocab = corpus_ids(300)
    model = build_llama(vocab, 64, 176, 2, 4, 2, 64)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
    torch.save({"ids": ids.int(), "vocab_size": vocab}, path / "tokens.pt")
    print(f"wrote a DCP checkpoint of an untrained tiny Llama (vocab {vocab}) to {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="", help="a DCP folder <out_dir>/checkpoints/step_<N> of launch/train.py")
    ap.add_argument("--tokens", default="", help="with --checkpoint: a .pt with the launcher's token ids")
    ap.add_argument("--config", default="", help="training TOML for the model sizes (default: llama_small_gpu on "
                                                 "CUDA, tiny_cpu on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary target (the corpus yields ~6.7k)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--selftest-dcp", default="", help="write a tiny DCP checkpoint to this folder and exit")
    args = ap.parse_args(argv)
    if args.selftest_dcp:
        selftest_dcp(Path(args.selftest_dcp))
        return
    device = torch.device(args.device)
    if not args.config:
        args.config = str(ROOT / "configs" / "train" / ("llama_small_gpu.toml" if device.type == "cuda" else "tiny_cpu.toml"))
    model, ids, meta = from_checkpoint(args, device) if args.checkpoint else train(args, device)
    fx = capture(model, ids, args.rows, args.seq, device, args.seed)
    fx["meta"].update(meta)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fx, out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import data as bench_data

    d = bench_data.describe(fx["hidden"], fx["weight"], fx["target"])
    print(f"wrote {out}: hidden {tuple(fx['hidden'].shape)}, weight {tuple(fx['weight'].shape)}; "
          f"capture loss {fx['meta']['capture_loss']:.3f}")
    print("data:", bench_data.describe_line(d))


if __name__ == "__main__":
    main()
