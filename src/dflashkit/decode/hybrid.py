"""The hybrid proposer: a suffix match where the output copies its context, the drafter elsewhere.

Usage:
    hybrid = HybridProposer(SuffixProposer(pool=pool), HybridGate(min_match=4, graft=True))
    spec = SpecDecoder(target, drafter, block_size=8, hybrid=hybrid)
    r = spec.generate(prompt_ids, SamplingParams(max_new_tokens=128, tenant="team-a"))
    r.branch          # per step: "suffix" | "drafter" | "graft" | "plain" | "none"
    r.draft_origin    # per step, per verified draft: "suffix" | "drafter" | "both"

One step of `SpecDecoder` with a hybrid (the committed sequence ends with the anchor x_start):
1. The suffix proposer drafts first (cheap, no forward): the continuation of the longest earlier match of
   the sequence's suffix, its match length and a score per token (`decode/suffix.py`).
2. The gate opens when that match is at least `min_match` tokens long (and its first token scores at least
   `min_score`): the suffix draft is verified and the drafter does not run this step. The target features
   of the tokens this step commits wait, and the drafter reads all of them at its next call, so its
   proposals are the ones it would have made had it run at every step.
3. Otherwise the drafter drafts its block. With `graft`, the drafter's leading tokens whose confidence is at
   least `graft_conf` stay (always its first), and where the suffix proposer matches at least
   `graft_min_match` tokens of the sequence extended by that prefix, its continuation replaces the
   drafter's next tokens; the drafter's own tokens fill what the continuation leaves of the block.
4. With `online_gate`, step 3 runs only while the drafter's steps commit tokens faster than plain target steps
   (`decode/online_gate.py`); where it is switched off the step verifies only the next token (branch "plain").

Verification is the decoder's, unchanged, so the output is the target's (greedy: its greedy output;
sampled: its law). Suffix tokens are point masses, as prompt lookup's: a grafted block verified against a
drafter's sampled law carries one-hot rows at the suffix positions, so the rejection rule stays exact.
Every verified draft token says where it came from: "drafter" or "suffix", or "both" where the token the
other branch proposed at that position is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.decode.suffix import SuffixDraft, SuffixProposer

Origin = Literal["drafter", "suffix", "both"]
# "plain": the online gate (`online_gate`) had the drafter off and the suffix gate did not open: nothing verified
Branch = Literal["suffix", "drafter", "graft", "plain", "none"]
BRANCHES: tuple[str, ...] = ("suffix", "drafter", "graft", "plain", "none")
NEVER = 1 << 30  # a `min_match` no match reaches: the suffix branch never drafts a block alone


@dataclass(frozen=True)
class HybridGate:
    """When the suffix branch drafts a step, and how a drafter block is grafted.

    Args:
        min_match: the suffix branch drafts alone when its match is at least this long (0: whenever it proposes
            anything; `NEVER`: never, the drafter always drafts).
        min_score: and when its first token's score (the empirical probability of that continuation) reaches this.
        graft: continue the drafter's confident prefix with the suffix match of the sequence extended by it.
        graft_min_match: the shortest match a graft continues from.
        graft_conf: the drafter's tokens are kept while their confidence (the draft head's probability) is at
            least this; the first one always.
        drafter_block: the drafter branch drafts at this block size (at most `drafter_block` − 1 tokens) while the
            suffix branch drafts up to the decoder's; 0 = the decoder's block size. Where a draft step's cost grows
            with its length (float32 drafting on a CPU without native bf16) and the drafter's deep positions are
            rarely accepted, a short drafter block beside long suffix drafts is the cheaper mix; a graft may
            continue a short drafter block up to the decoder's block size.
        online_gate: the decoder measures, per request, whether the drafter's steps commit tokens faster than
            plain target steps, and switches the drafter off where they do not (`decode/online_gate.py`; its knobs
            are `OnlineGate`'s defaults). Off by default: unmeasured, and it can cost a request its probes.
    """

    min_match: int = 4
    min_score: float = 0.0
    graft: bool = False
    graft_min_match: int = 2
    graft_conf: float = 0.5
    drafter_block: int = 0
    online_gate: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.min_match < 0:
            problems.append(f"min_match must be >= 0, got {self.min_match}")
        if self.graft_min_match < 1:
            problems.append(f"graft_min_match must be >= 1, got {self.graft_min_match}")
        if self.drafter_block != 0 and self.drafter_block < 2:
            problems.append(f"drafter_block must be 0 (the decoder's block) or >= 2, got {self.drafter_block}")
        for name in ("min_score", "graft_conf"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                problems.append(f"{name} must lie in [0, 1], got {value}")
        if problems:
            raise UsageError("hybrid gate: " + "; ".join(problems),
                             hint="min_match counts tokens (0 = any match); scores and confidences are probabilities")


@dataclass(frozen=True)
class Graft:
    """A drafter block continued by a suffix match: the tokens, their confidences (the drafter's, the suffix
    scores at `suffix_rows`) and each token's origin."""

    tokens: list[int]
    conf: list[float]
    origin: list[str]
    suffix_rows: list[int]


def label(tokens: list[int], other: list[int], own: str) -> list[str]:
    """Per token: "both" where `other` proposed the same token at that position, else `own`."""
    return ["both" if i < len(other) and other[i] == t else own for i, t in enumerate(tokens)]


class HybridProposer:
    """The suffix proposer and the gate that decides, per step, which branch drafts (module docstring).

    The drafter itself belongs to the decoder (`SpecDecoder(target, drafter, B, hybrid=...)`), which runs it
    only on the steps this proposer leaves to it.
    """

    def __init__(self, suffix: SuffixProposer, gate: HybridGate | None = None):
        self.suffix = suffix
        self.gate = gate or HybridGate()

    def begin(self, prompt_ids: list[int], tenant: str | None = None) -> None:
        """A new request: the suffix proposer indexes its prompt (and reads this tenant's pool)."""
        hook = getattr(self.suffix, "begin", None)
        if hook is not None:
            hook(prompt_ids, tenant)

    def finish(self, sequence: list[int] | None = None) -> None:
        """The request ended (`sequence`: its prompt + output): they go to the suffix proposer's pool."""
        hook = getattr(self.suffix, "finish", None)
        if hook is not None:
            hook(sequence)

    def suffix_draft(self, sequence: list[int], num_tokens: int) -> SuffixDraft:
        """The suffix proposer's draft of up to `num_tokens` tokens after `sequence` (committed tokens only)."""
        return self.suffix.propose_scored(sequence, num_tokens)

    def opens(self, draft: SuffixDraft) -> bool:
        """Whether the suffix branch drafts this step alone."""
        g = self.gate
        return bool(draft.tokens) and draft.match_len >= g.min_match and draft.scores[0] >= g.min_score

    def drafter_drafts(self, k: int) -> int:
        """How many tokens the drafter branch drafts when the decoder's step drafts up to `k`."""
        b = self.gate.drafter_block
        return k if b == 0 else min(k, b - 1)

    def graft(self, sequence: list[int], tokens: list[int], conf: list[float], suffix_tokens: list[int],
              size: int | None = None) -> Graft | None:
        """The drafter's block `tokens` (confidences `conf`) after `sequence`, continued by a suffix match up to
        `size` tokens in all (default: the block's length), or None where nothing is grafted (the whole block is
        confident and fills `size`, or no match of `graft_min_match` follows the kept prefix). `suffix_tokens`:
        what the suffix branch proposed after `sequence` (labels "both")."""
        n, g = len(tokens), self.gate
        k = max(n, size or n)
        keep = 1
        while keep < n and conf[keep - 1] >= g.graft_conf and conf[keep] >= g.graft_conf:
            keep += 1
        if keep >= k:
            return None
        draft = self.suffix.propose_scored(sequence, k - keep, pending=tokens[:keep])  # the prefix is not indexed
        if draft.match_len < g.graft_min_match or not draft.tokens:
            return None
        cont = list(draft.tokens[: k - keep])
        end = keep + len(cont)
        origin = (label(tokens[:keep], suffix_tokens, "drafter") + label(cont, tokens[keep:end], "suffix")
                  + label(tokens[end:], suffix_tokens[end:], "drafter"))
        return Graft(tokens=tokens[:keep] + cont + tokens[end:],
                     conf=list(conf[:keep]) + list(draft.scores[: len(cont)]) + list(conf[end:]),
                     origin=origin, suffix_rows=list(range(keep, end)))
