"""`dflashkit bench seqlen`: train peak memory and step time of one packed row against its length S.

Usage:
    dflashkit bench seqlen -c run.yaml                       # S = 2048, 8192, 32768; 3 timed steps each
    dflashkit bench seqlen -c run.yaml 1024,4096 5           # these S, 5 timed steps each

Each S runs in a fresh child process (so one length's memory high-water mark cannot hide another's): one
row of S tokens packed (`train.pack`) from documents of `train.pack_length`-or-`tokenize.max_length` tokens
(the last one shorter), random token ids with the last 3/4 of each document supervised, random cached-style
features [1, S, n_feat·H] (packing trains on cached features, so no target forward is timed), anchors drawn
per document (`train.num_anchors` each). One warm-up step, then the median of the timed drafter steps
(forward + chunked loss + backward + AdamW). Reported per S: documents, anchors, block queries q = anchors·B,
step time, the child's peak RSS (`ru_maxrss`) and its rise over the setup (target, drafter, features) — the
step's own peak — and on CUDA `torch.cuda.max_memory_allocated`.

What grows with S: the drafter attends q block queries over S + q keys (mask and scores q·(S + q) per head
and layer); no [S, S] tensor is built on the training path. With a fixed anchors-per-document cap q grows
with S, so the attention term is ~S²·(anchors per token)²·B; the rest (features, K/V, positions) is linear.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.errors import UsageError
from dflashkit.family import new_drafter
from dflashkit.inspect.contract import run_contract
from dflashkit.train.loss import CE, Decay, DraftLoss, Heads, LossInputs
from dflashkit.train.objective import gamma_for, sample_anchors
from dflashkit.train.optim import build_optimizer
from dflashkit.timing import median_time, seconds

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.family.contract import DrafterContract
    from dflashkit.rundir import RunDir

DEFAULT_LENGTHS = (2048, 8192, 32768)


def packed_row(s: int, doc_len: int, vocab: int, *, seed: int = 0):
    """(ids [1, s], loss_mask [1, s], seq_lens [1], docs) of one row of s tokens packed from documents of
    `doc_len` tokens (the last one shorter), the last 3/4 of each document supervised."""
    lens = [doc_len] * (s // doc_len) + ([s % doc_len] if s % doc_len else [])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, s), generator=g)
    lm = torch.zeros(1, s, dtype=torch.long)
    off = 0
    for n in lens:
        lm[0, off + n // 4:off + n] = 1
        off += n
    return ids, lm, torch.tensor([s]), [[(n, k) for k, n in enumerate(lens)]]


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(cfg: RunConfig, contract: DrafterContract, s: int, iters: int, out: Any) -> None:
    """One S in this (child) process; puts a row dict (or {"error": ...}) on `out`."""
    try:
        from dflashkit.target.load import load_target

        target = load_target(cfg.target)
        dev = target.device
        doc_len = cfg.train.pack_length or cfg.tokenize.max_length
        ids, lm, lens, docs = packed_row(s, doc_len, target.vocab_size)
        ids, lm, lens = ids.to(dev), lm.to(dev), lens.to(dev)
        B = contract.block_size
        a = sample_anchors(lm, lens, num_anchors=cfg.train.num_anchors, block_size=B, seeds=[0], docs=docs)
        torch.manual_seed(cfg.run.seed)
        drafter = new_drafter(contract).to(dev)
        opt = build_optimizer(drafter, cfg.train)
        fam = contract.family
        loss = DraftLoss(fam, contract.mask_token_id, (CE(), *fam.terms(cfg.train.weights)),
                         Decay(gamma_for(cfg.train.gamma, B)), chunk_blocks=cfg.train.loss_chunk_blocks)
        heads = Heads(target.model.get_input_embeddings(), target.lm_head)
        feats = torch.randn(1, s, len(contract.target_layer_ids) * contract.hidden_size, device=dev)
        x = LossInputs(feats, ids, lm, lens)

        def step() -> None:
            loss(drafter, heads, x, a).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        setup_mb = _maxrss_mb()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        seconds(step, dev)  # warm-up
        t = median_time(step, dev, iters)
        peak_mb = _maxrss_mb()
        n = int(a.keep.sum())
        row = {"seq_len": s, "documents": len(docs[0]), "anchors": n, "queries": n * B, "step_s": round(t, 4),
               "tokens_per_s": round(s / t, 1), "peak_rss_mb": round(peak_mb, 1),
               "step_rss_mb": round(peak_mb - setup_mb, 1)}
        if dev.type == "cuda":
            row["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
        out.put(row)
    except Exception as e:  # noqa: BLE001 - reported as this length's row (e.g. out of memory)
        out.put({"seq_len": s, "error": f"{type(e).__name__}: {e}"})


def _lengths(ctx: StageContext) -> tuple[list[int], int]:
    pos = ctx.positionals
    try:
        lengths = [int(v) for v in pos[1].split(",")] if len(pos) > 1 else list(DEFAULT_LENGTHS)
        iters = int(pos[2]) if len(pos) > 2 else 3
    except ValueError:
        raise UsageError(f"bench seqlen: {' '.join(pos[1:])!r} is not `S1,S2,... [iters]`",
                         hint="e.g. dflashkit bench seqlen -c run.yaml 2048,8192,32768 3") from None
    if not lengths or min(lengths) < 2 or iters < 1:
        raise UsageError("bench seqlen: every S must be >= 2 and iters >= 1",
                         hint="e.g. dflashkit bench seqlen -c run.yaml 2048,8192,32768 3")
    return lengths, iters


def bench_seqlen(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    """Measure each S in a child process (see the module docstring); returns the table's rows."""
    from dflashkit.target.load import cpu_facts

    lengths, iters = _lengths(ctx)
    contract = run_contract(cfg, rd)
    spawn = mp.get_context("spawn")
    rows = []
    for s in lengths:
        q = spawn.Queue()
        p = spawn.Process(target=_measure, args=(cfg, contract, s, iters, q))
        p.start()
        p.join()
        rows.append(q.get() if not q.empty() else {"seq_len": s, "error": f"child exited with {p.exitcode}"})
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", **cpu_facts(),
              "threads": torch.get_num_threads(), "target": str(cfg.target.path), "block_size": contract.block_size,
              "num_anchors_per_document": cfg.train.num_anchors,
              "document_tokens": cfg.train.pack_length or cfg.tokenize.max_length, "iters": iters, "rows": rows}
    if not ctx.json:
        cols = ["seq_len", "documents", "anchors", "queries", "step_s", "tokens_per_s", "peak_rss_mb", "step_rss_mb"]
        print("  ".join(f"{c:>12}" for c in cols))
        for r in rows:
            print(f"{r['seq_len']:>12}  {r['error']}" if "error" in r else "  ".join(f"{r.get(c, ''):>12}" for c in cols))
    return result
