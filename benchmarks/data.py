"""Benchmark inputs ``(x [n, h], w [v, h], target [n])`` by data mode, and ``describe()``, the
numbers that say how peaked the softmax of ``x @ w.T`` is.

Why: on random ``x``, ``w`` the softmax is nearly uniform. A peer whose speed depends on how peaked
it is (Apple's CCE skips every (token-block x vocab-block) of the gradient whose entries are all
below ``filter_eps`` = 2^-12 in bf16, after sorting the vocabulary by mean logit) is then timed on
data no trained model produces. Every benchmark runs the same call on each mode.

Modes (``make_inputs(n, h, v, mode=..., dtype=..., device=..., seed=...)``):

``random``  exactly what ``bench.py`` and ``bench_tp.py`` did before data modes existed (same
    generator calls in the same order, so old numbers stay comparable):
        g = torch.Generator(device).manual_seed(seed)
        x = randn(n, h) ; w = randn(v, h) * h**-0.5 ; target = randint(0, v, (n,))
    Logits ~ N(0, 1) per entry: loss ~ ln(v) + 0.5 nats (~12 at v=128k), entropy near ln(v).

``realistic``  a synthetic stand-in for a trained LM head: a few elementwise ops, w generated in
    chunks, and one calibration matmul on ``calib_rows`` rows. In logit space
        z[n, v] = c[v] + tau * eps[n, v] + beta[n] * sum_k r[n, k] * [v == a[n, k]]   (+ cross terms)
    with
      * c[v] = log p[v] - mean(log p): a Zipf unigram prior, p[rank] ~ (rank + 1)^-zipf_s
        (zipf_s = 1, the frequency-to-logit direction of a trained head); ``rank`` is mapped to
        token ids by a seeded permutation (real tokenizers do not sort by frequency; CCE sorts
        internally), or the identity with ``sorted_vocab=True``;
      * tau * eps: context noise, tau = ``noise`` (1.5);
      * candidates a[n, 0..K] drawn from p, a[n, 0] = target[n] (so targets are long-tailed: the top
        1% of the vocab holds ~60% of them at v=128k), K = ``alternatives`` (4) plausible other
        tokens; r[n, 0] = 1 and r[n, k] ~ U(0, 0.9) (0 for a repeated token): the hidden state puts
        its margin beta[n] on the target and less on the alternatives, so the mass sits on a few
        tokens and the mean entropy comes out near the mean loss, as for a calibrated model;
      * beta[n] = mu + ``spread`` * N(0, 1) (spread 3): some tokens confident (loss ~ 0), some not;
        mu is found by bisection on the first ``calib_rows`` rows so that the mean loss is
        ``target_loss`` (2.5 nats).
    As tensors: G [v, h] random unit rows orthogonal to a random unit direction u that carries the
    prior; b = sqrt(h) / 4 is x's component along u:
        w[v] = G[v] + (c[v] / b) * u
        x[n] = tau * e[n] + b * u + beta[n] * sum_k r[n, k] * G[a[n, k]]     e[n] ~ N(0, I) off u
    so x[n] . w[v] = c[v] + tau * N(0, 1) + the bumps, up to cross terms G[a] . G[v] ~ N(0, 1/h).
    Elements of w have std ~h^-0.5 (like random mode and a trained lm_head), elements of x ~tau.
    At v=262208 (h=1024, CPU): loss 2.5, entropy 2.6 +- 2.8, max logit ~18, logit std ~1.9,
    negligible 128x128 blocks 22% in token order, 88% with the vocab sorted by mean logit.
    ``tail`` > 1 pushes the below-average prior logits further down (1: off).
    Cost: w is generated in 16384-row chunks (float32 temporaries of 16384 x h, plus the
    calibration logits [calib_rows, 16384]); no [n, v] tensor ever exists. Deterministic from
    ``seed`` on a given device (CPU and CUDA generators differ).

``trained``  hidden states, lm_head and targets of a model that was actually trained, saved by
    ``benchmarks/capture_trained.py`` (``fixture=``: a .pt file with ``hidden [m, H]``, ``weight
    [V, H]``, ``target [m]``). Rows are tiled to ``n``; ``h``, ``v`` must match the fixture
    (pass None to take the fixture's).

``describe(x, w, target)`` works on the first ``max_rows`` rows (two passes over the vocabulary
in chunks, float32 accumulation) and returns the mean loss, entropy, max logit and logit std per
row, and the fraction of (block[0] rows x block[1] vocab) blocks in which every
|softmax - onehot| < eps, both in the given vocab order (``skip_frac``) and with the vocab sorted
by mean logit as CCE sorts it (``skip_frac_sorted``, the one that predicts CCE's skipping).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

MODES = ("random", "realistic", "trained")
_CHUNK = 16384  # vocab rows per generation / describe chunk (fixed: the output depends on it)


def make_inputs(n: int, h: int | None, v: int | None, *, mode: str = "random", dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu", seed: int = 0, sorted_vocab: bool = False,
                fixture: str | Path | None = None, target_loss: float = 2.5, zipf_s: float = 1.0,
                noise: float = 1.5, spread: float = 3.0, tail: float = 1.0, alternatives: int = 4,
                calib_rows: int = 512):
    """``(x [n, h], w [v, h], target [n] int64)`` on ``device`` in ``dtype``; see the module
    docstring for the modes. Neither tensor requires grad."""
    if mode == "random":
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(n, h, device=device, dtype=dtype, generator=g)
        w = torch.randn(v, h, device=device, dtype=dtype, generator=g) * h**-0.5
        t = torch.randint(0, v, (n,), device=device, generator=g)
        return x, w, t
    if mode == "realistic":
        return _realistic(n, h, v, dtype=dtype, device=torch.device(device), seed=seed, sorted_vocab=sorted_vocab,
                          target_loss=target_loss, zipf_s=zipf_s, noise=noise, spread=spread, tail=tail,
                          alternatives=alternatives, calib_rows=calib_rows)
    if mode == "trained":
        return load_fixture(fixture, n, h, v, dtype=dtype, device=device)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def zipf_logp(v: int, s: float = 1.0, device=None) -> torch.Tensor:
    """log p[rank] of a Zipf distribution over ``v`` ranks, p ~ (rank + 1)^-s, float64."""
    lp = -s * torch.log(torch.arange(1, v + 1, device=device, dtype=torch.float64))
    return lp - torch.logsumexp(lp, 0)


def _realistic(n, h, v, *, dtype, device, seed, sorted_vocab, target_loss, zipf_s, noise, spread, tail, alternatives,
               calib_rows):
    g = torch.Generator(device=device).manual_seed(seed)
    f32 = torch.float32
    lp_rank = zipf_logp(v, zipf_s, device)
    perm = torch.arange(v, device=device) if sorted_vocab else torch.randperm(v, device=device, generator=g)
    lp = torch.empty_like(lp_rank)
    lp[perm] = lp_rank  # log p by token id
    c = (lp - lp.mean()).to(f32)
    c = torch.where(c < 0, c * tail, c)
    u = torch.randn(h, device=device, dtype=f32, generator=g)
    u /= u.norm()
    b = math.sqrt(h) / 4
    k = alternatives
    ranks = torch.multinomial(lp_rank.exp().to(f32), n * (1 + k), replacement=True, generator=g).view(n, 1 + k)
    cand = perm[ranks]  # [n, 1 + k]: the target, then its alternatives
    t = cand[:, 0].contiguous()
    ratio = torch.cat([torch.ones(n, 1, device=device), 0.9 * torch.rand(n, k, device=device, generator=g)], 1)
    earlier = torch.ones(1 + k, 1 + k, device=device, dtype=torch.bool).tril(-1)
    dup = ((cand[:, :, None] == cand[:, None, :]) & earlier).any(2)  # a token already among the earlier candidates
    ratio[dup] = 0.0
    e = torch.randn(n, h, device=device, dtype=f32, generator=g)
    x0 = noise * (e - (e @ u)[:, None] * u) + b * u  # [n, h] without the candidate terms
    del e
    m = min(n, calib_rows)
    xc = x0[:m].to(dtype).to(f32)
    cc = cand[:m]
    w = torch.empty(v, h, device=device, dtype=dtype)
    run_max = torch.full((m,), -math.inf, device=device, dtype=f32)
    run_sum = torch.zeros(m, device=device, dtype=f32)
    for s0 in range(0, v, _CHUNK):
        s1 = min(v, s0 + _CHUNK)
        gc = torch.randn(s1 - s0, h, device=device, dtype=f32, generator=g)
        gc -= (gc @ u)[:, None] * u
        gc /= gc.norm(dim=1, keepdim=True)
        w[s0:s1] = gc + (c[s0:s1, None] / b) * u
        z = xc @ w[s0:s1].to(f32).T  # calibration logits [m, chunk], candidate columns excluded
        r, j = ((cc >= s0) & (cc < s1)).nonzero(as_tuple=True)
        z[r, cc[r, j] - s0] = -math.inf
        cm = torch.maximum(run_max, z.max(1).values)
        run_sum = run_sum * torch.exp(run_max - cm) + torch.exp(z - cm[:, None]).sum(1)
        run_max = cm
    lse_rest = (run_max + run_sum.log()).double()
    wc = w[cand].to(f32)  # [n, 1 + k, h]
    gcand = wc - (c[cand][..., None] / b) * u  # G[candidates]: unit rows orthogonal to u
    dirn = (ratio[..., None] * gcand).sum(1)  # [n, h]: logit +1 on the target, +ratio on each alternative
    del gcand
    zc0 = torch.einsum("mh,mkh->mk", xc, wc[:m]).double()  # [m, 1 + k] candidate logits without the bumps
    del wc
    zeta = torch.randn(n, device=device, dtype=f32, generator=g)
    zc = zeta[:m].double()
    rc, dupc = ratio[:m].double(), dup[:m]

    def mean_loss(mu: float) -> float:  # the candidates' mutual cross terms (~1/sqrt(h)) are left out
        zk = (zc0 + (mu + spread * zc)[:, None] * rc).masked_fill(dupc, -math.inf)
        lse = torch.logaddexp(lse_rest, torch.logsumexp(zk, 1))
        return (lse - zk[:, 0]).mean().item()

    lo, hi = -100.0, 100.0
    for _ in range(60):  # the mean loss decreases with mu
        mu = (lo + hi) / 2
        lo, hi = (mu, hi) if mean_loss(mu) > target_loss else (lo, mu)
    beta = (lo + hi) / 2 + spread * zeta
    x = (x0 + beta[:, None] * dirn).to(dtype)
    return x, w, t


def load_fixture(path, n: int, h: int | None = None, v: int | None = None, *, dtype=torch.bfloat16, device="cpu"):
    """``(x [n, H], w [V, H], target [n])`` from a ``capture_trained.py`` fixture, rows tiled to ``n``."""
    if path is None:
        raise ValueError("mode='trained' needs fixture= (a .pt file written by benchmarks/capture_trained.py)")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    hid, w, t = blob["hidden"], blob["weight"], blob["target"].long()
    if (h is not None and hid.shape[1] != h) or (v is not None and w.shape[0] != v):
        raise ValueError(f"fixture {path} holds H={hid.shape[1]}, V={w.shape[0]}; asked for h={h}, v={v}")
    reps = -(-n // hid.shape[0])
    idx = torch.arange(n) % hid.shape[0] if reps > 1 else torch.arange(n)
    return (hid[idx].to(device=device, dtype=dtype).contiguous(), w.to(device=device, dtype=dtype).contiguous(),
            t[idx].to(device))


def cases(shapes: str, data: list[str], table: dict[str, tuple[int, int]],
          fixture: str | Path | None = None) -> list[tuple[str, str, int, int]]:
    """``(shape name, data mode, H, V)`` in run order: per shape of the comma list ``shapes``
    (``table``: name -> (H, V)), each data mode; ``trained`` runs once at the fixture's own H and V."""
    out = [(name, d, *table[name]) for name in shapes.split(",") for d in data if d != "trained"]
    if "trained" in data:
        out.append(("trained", "trained", *fixture_shape(fixture)))
    return out


def fixture_shape(path) -> tuple[int, int]:
    """(H, V) of a fixture."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    return int(blob["hidden"].shape[1]), int(blob["weight"].shape[0])


@torch.no_grad()
def describe(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, *, block=(128, 128), eps: float = 2**-12,
             max_rows: int = 1024) -> dict:
    """Softmax statistics of ``x @ w.T`` on the first ``max_rows`` rows (float32 accumulation):
    ``loss`` (mean nats), ``entropy`` (mean nats) and ``entropy_std`` (its spread over rows),
    ``max_logit`` (mean per-row max), ``logit_std`` (mean per-row std over the vocab),
    ``skip_frac`` / ``skip_frac_sorted``: fraction of (block[0] rows x block[1] vocab) blocks in which
    every |softmax - onehot| < ``eps``, in the given vocab order / sorted by mean logit over these
    rows (as CCE orders its backward when ``filter_eps`` is on), and ``rows``."""
    f32 = torch.float32
    m = min(x.shape[0], max_rows)
    xs = x[:m].detach().to(f32)
    t = target[:m].to(xs.device)
    v = w.shape[0]
    run_max = torch.full((m,), -math.inf, device=xs.device, dtype=f32)
    run_sum = torch.zeros(m, device=xs.device, dtype=f32)
    run_pz = torch.zeros(m, device=xs.device, dtype=f32)  # sum exp(z - max) * z
    s1z = torch.zeros(m, device=xs.device, dtype=torch.float64)
    s2z = torch.zeros(m, device=xs.device, dtype=torch.float64)
    zt = torch.zeros(m, device=xs.device, dtype=f32)
    col_sum = torch.zeros(v, device=xs.device, dtype=f32)
    rows = torch.arange(m, device=xs.device)
    for s0 in range(0, v, _CHUNK):
        s1 = min(v, s0 + _CHUNK)
        z = xs @ w[s0:s1].detach().to(f32).T
        cm = torch.maximum(run_max, z.max(1).values)
        scale = torch.exp(run_max - cm)
        ez = torch.exp(z - cm[:, None])
        run_sum = run_sum * scale + ez.sum(1)
        run_pz = run_pz * scale + (ez * z).sum(1)
        run_max = cm
        s1z += z.sum(1, dtype=torch.float64)
        s2z += (z.double() ** 2).sum(1)
        col_sum[s0:s1] = z.sum(0)
        inside = (t >= s0) & (t < s1)
        zt[inside] = z[rows[inside], (t - s0)[inside]]
    lse = run_max + run_sum.log()
    ent = lse - run_pz / run_sum
    mean = s1z / v
    std = (s2z / v - mean**2).clamp_min(0).sqrt()
    # pass 2: per (row block, vocab column) max |softmax - onehot|
    nrb = -(-m // block[0])
    colmax = torch.zeros(nrb, v, device=xs.device, dtype=f32)
    for s0 in range(0, v, _CHUNK):
        s1 = min(v, s0 + _CHUNK)
        p = torch.exp(xs @ w[s0:s1].detach().to(f32).T - lse[:, None])
        inside = (t >= s0) & (t < s1)
        p[rows[inside], (t - s0)[inside]] -= 1.0
        p = p.abs()
        pad = nrb * block[0] - m
        if pad:
            p = torch.cat([p, p.new_zeros(pad, p.shape[1])])
        colmax[:, s0:s1] = p.view(nrb, block[0], -1).amax(1)

    def frac(cm: torch.Tensor) -> float:
        pad = -v % block[1]
        if pad:
            cm = torch.cat([cm, cm.new_zeros(nrb, pad)], 1)
        return (cm.view(nrb, -1, block[1]).amax(2) < eps).float().mean().item()

    return dict(loss=(lse - zt).mean().item(), entropy=ent.mean().item(), entropy_std=ent.std().item() if m > 1 else 0.0,
                max_logit=run_max.mean().item(), logit_std=std.mean().item(), skip_frac=frac(colmax),
                skip_frac_sorted=frac(colmax[:, torch.argsort(col_sum)]), rows=m)


# the describe() keys the benchmarks put in their CSVs (prefixed ``d_``) and print
DESCRIBE_KEYS = ("loss", "entropy", "max_logit", "logit_std", "skip_frac", "skip_frac_sorted")


def describe_line(d: dict) -> str:
    return (f"loss {d['loss']:.2f} nats, entropy {d['entropy']:.2f} (std {d['entropy_std']:.2f}), max logit "
            f"{d['max_logit']:.1f}, logit std {d['logit_std']:.2f}, negligible blocks {d['skip_frac']:.3f} (vocab sorted by mean logit: {d['skip_frac_sorted']:.3f}), {d['rows']} rows")


DATA_MODES = ("random", "realistic", "trained")


def add_data_args(ap) -> None:
    """The data-mode options every benchmark takes (``--data``, ``--fixture``, ``--sorted-vocab``)."""
    ap.add_argument("--data", default="random,realistic", help=f"comma list of data modes from {DATA_MODES}")
    ap.add_argument("--fixture", default="", help="the .pt fixture of --data trained (benchmarks/capture_trained.py)")
    ap.add_argument("--sorted-vocab", action="store_true", help="realistic mode: token ids in frequency order")


def check_data_args(ap, args) -> None:
    """Split ``args.data`` into a list and reject unknown modes (``ap.error``)."""
    args.data = [d for d in args.data.split(",") if d]
    bad = [d for d in args.data if d not in DATA_MODES]
    if bad or not args.data:
        ap.error(f"--data: unknown mode(s) {bad} (choose from {DATA_MODES})")
    if "trained" in args.data and not args.fixture:
        ap.error("--data trained needs --fixture PATH (benchmarks/capture_trained.py writes one)")
