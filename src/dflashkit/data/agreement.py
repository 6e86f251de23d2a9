"""Teacher-forced agreement: the share of supervised labels that are the target's own argmax.

Usage:
    pick = Reservoir(per_key=16, seed=0)
    for s in samples: pick.offer(s.source, (s.input_ids, s.loss_mask))     # while streaming
    agree, total = label_agreement(target.model, pick.items["sharegpt"], device=target.device)
    report = agreement_report(target.model, pick, device=target.device)   # {key: {samples, labels, ...}}

Why: a drafter learns to predict the target's next tokens, so every supervised label should be
one. Data regenerated greedily by the target, rendered with the template it was served with and
tokenized as it was generated, agrees fully (fp32); a server that saw another prompt (a different
chat template) or sampled differently (a repetition penalty, min_p) agrees visibly less
(docs/architecture.md, "Drift from the server"). The check needs nothing from the server.

The label at position t is supervised when loss_mask[t] = 1; the target's prediction for it is
the argmax of its logits at t − 1 over the sequence's own prefix. Sequences are batched by
length with right padding (causal attention: padding after a token never changes its logits),
and the head runs only on supervised positions, in chunks.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Hashable, cast

import numpy as np

if TYPE_CHECKING:
    from dflashkit.config import TargetSection

HEAD_CHUNK = 512  # supervised positions per lm_head call (bounds the [n, vocab] logits)


class Reservoir:
    """Uniform sample of at most `per_key` items per key from a stream (seeded, order-deterministic)."""

    def __init__(self, per_key: int, seed: int = 0):
        self.per_key = per_key
        self.rng = random.Random(seed)
        self.seen: Counter = Counter()
        self.items: dict[Hashable, list[Any]] = {}

    def offer(self, key: Hashable, item: Any) -> None:
        n = self.seen[key]
        self.seen[key] += 1
        bucket = self.items.setdefault(key, [])
        if n < self.per_key:
            bucket.append(item)
        else:
            j = self.rng.randrange(n + 1)
            if j < self.per_key:
                bucket[j] = item


def _batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def label_agreement(model: Any, seqs: list[tuple[np.ndarray, np.ndarray]], *, device: Any,
                    batch_tokens: int = 4096) -> tuple[int, int]:
    """(labels equal to the target's argmax, supervised labels) over `seqs` = [(input_ids, loss_mask)].

    Args:
        model: a HF causal LM (the frozen target); its base model and output embeddings are used.
        seqs: token ids [T] and loss masks [T] (1 = supervised label).
        device: where the model is.
        batch_tokens: padded tokens per forward.
    """
    import torch

    base, head = model.base_model, model.get_output_embeddings()
    agree = total = 0
    lengths = [len(ids) for ids, _ in seqs]
    with torch.no_grad():
        for batch in _batches(lengths, batch_tokens):
            width = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            att = torch.zeros(len(batch), width, dtype=torch.long)
            sup = torch.zeros(len(batch), width, dtype=torch.bool)
            for r, i in enumerate(batch):
                n = lengths[i]
                ids[r, :n] = torch.from_numpy(np.asarray(seqs[i][0], dtype=np.int64))
                att[r, :n] = 1
                sup[r, :n] = torch.from_numpy(np.asarray(seqs[i][1]) == 1)
            sup[:, 0] = False  # nothing predicts the first token
            rows, cols = sup.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            hidden = base(input_ids=ids.to(device), attention_mask=att.to(device)).last_hidden_state  # [b, T, H]
            labels = ids[rows, cols].to(device)
            for a in range(0, rows.numel(), HEAD_CHUNK):
                r, c = rows[a:a + HEAD_CHUNK].to(device), cols[a:a + HEAD_CHUNK].to(device)
                pred = head(hidden[r, c - 1]).argmax(-1)                                          # [n]
                agree += int((pred == labels[a:a + HEAD_CHUNK]).sum())
            total += int(rows.numel())
    return agree, total


def agreement_report(model: Any, pick: Reservoir, *, device: Any, batch_tokens: int = 4096,
                     ) -> dict[Hashable, dict[str, Any]]:
    """Per reservoir key: {samples_total, samples, labels, agree, agreement (None if no labels)}."""
    out: dict[Hashable, dict[str, Any]] = {}
    for key, seqs in pick.items.items():
        agree, total = label_agreement(model, seqs, device=device, batch_tokens=batch_tokens)
        out[key] = {"samples_total": pick.seen[key], "samples": len(seqs), "labels": total, "agree": agree,
                    "agreement": round(agree / total, 4) if total else None}
    return out


def check_sources(target_section: TargetSection, pick: Reservoir, *, temperature: float | None, min_agreement: float,
                  ) -> dict[str, Any]:
    """Load the target and measure agreement per (source, regenerated) key of `pick`.

    A source is judged against `min_agreement` only when its answers were regenerated by the
    target greedily (`temperature` 0); the others are reported.
    """
    from dflashkit.target.load import load_target

    if not pick.items:
        return {"status": "skipped", "detail": "no samples"}
    t0 = time.time()
    target = load_target(target_section, with_tokenizer=False)
    report = agreement_report(target.model, pick, device=target.device)
    sources = {}
    # the reservoir's keys are (source name, regenerated): what tokenize offers it
    keyed = [(cast(tuple[str, bool], k), v) for k, v in report.items()]
    for (source, regenerated), r in sorted(keyed, key=lambda kv: (not kv[0][1], kv[0][0])):
        name = (source or "(no source)") + ("" if regenerated else " (not regenerated)")
        sources[name] = {**r, "regenerated": regenerated,
                         "judged": bool(regenerated and not temperature and r["agreement"] is not None)}
    return {"status": "checked", "min_agreement": min_agreement, "generate_temperature": temperature,
            "dtype": str(target.dtype).replace("torch.", ""), "seconds": round(time.time() - t0, 2),
            "sources": sources}


def agreement_lines(agreement: dict[str, Any]) -> list[str]:
    """Human lines, one per source (or why the check did not run)."""
    if agreement.get("status") != "checked":
        return [f"teacher-forced agreement: {agreement.get('status')}"
                + (f" ({agreement['detail']})" if agreement.get("detail") else "")]
    out = []
    for name, r in agreement["sources"].items():
        why = "" if r["judged"] else (" (report only: not regenerated by the target)" if not r["regenerated"]
                                      else " (report only: generated at temperature > 0)")
        share = f"{r['agreement']:.1%}" if r["agreement"] is not None else "n/a"
        out.append(f"teacher-forced agreement [{name}]: {share} of {r['labels']} supervised labels are the "
                   f"target's argmax ({r['samples']} of {r['samples_total']} samples){why}")
    return out
