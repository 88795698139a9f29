"""Compare greedy outputs with transformers, tolerating only proven near-ties.

Where an output first differs from its reference, the two tokens must be within a tolerance of each other in the
reference's own logits at that step; and only a few prompts may differ at all. In fp32 the tolerance is 1e-3 and
1 prompt in 20 may differ (the tests' rule); in bf16 the GPU check widens it relative to the logit."""
from __future__ import annotations

import torch

NEAR_TIE_ABS_TOL = 1e-3


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def is_near_tie(reference_logit: float, other_logit: float, rel_tol: float = 0.0,
                abs_tol: float = NEAR_TIE_ABS_TOL) -> bool:
    """|logit(reference token) - logit(our token)| <= tol in the reference's logits, with a tolerance that may
    scale with the logit: bf16 logits are rounded to 8 significant bits, so two candidates a few units in the last
    place apart are a tie that rounding in either implementation can break."""
    return abs(reference_logit - other_logit) <= abs_tol + rel_tol * max(abs(reference_logit), abs(other_logit))


def allowed_divergences(num_prompts: int) -> int:
    """1 prompt in 20, at least one."""
    return max(1, num_prompts // 20)


def greedy_verdict(references: list[list[int]], reference_logits, outputs: list[list[int]], rel_tol: float,
                   abs_tol: float, max_divergences: int) -> dict:
    """Every output equals its reference, except at most max_divergences that first differ at a near-tie.
    reference_logits[i][step][token] is the reference's logit of `token` at that step of prompt i (only looked up
    where output i first differs)."""
    divergences = []
    for i, (ref, ours) in enumerate(zip(references, outputs)):
        step = first_divergence(ref, ours)
        if step is None:
            continue
        entry = {"prompt": i, "step": step, "near_tie": False}
        if step < len(ref) and step < len(ours):  # else one stopped early: not a tie between two tokens
            a, b = float(reference_logits[i][step][ref[step]]), float(reference_logits[i][step][ours[step]])
            entry.update(reference_token=ref[step], our_token=ours[step], reference_logit=a, our_token_logit=b,
                         near_tie=is_near_tie(a, b, rel_tol, abs_tol))
        divergences.append(entry)
    ok = all(d["near_tie"] for d in divergences) and len(divergences) <= max_divergences
    return {"ok": ok, "prompts": len(references), "identical": len(references) - len(divergences),
            "divergences": divergences, "rule": {"rel_tol": rel_tol, "abs_tol": abs_tol,
                                                 "max_divergences": max_divergences}}


def assert_greedy_matches(hf_model, prompts: list[list[int]], references: list[list[int]],
                          outputs: list[list[int]]) -> list[int]:
    """The fp32 rule against transformers' model: every output equals its reference, except near-ties (within
    NEAR_TIE_ABS_TOL) in at most 1 prompt in 20 (at least one allowed). Returns the steps where outputs diverged."""
    logits: dict[int, dict[int, torch.Tensor]] = {}
    for i, (prompt, ref, ours) in enumerate(zip(prompts, references, outputs)):
        step = first_divergence(ref, ours)
        if step is not None and step < min(len(ref), len(ours)):
            logits[i] = {step: next_token_logits(hf_model, prompt + ref[:step])}
    verdict = greedy_verdict(references, logits, outputs, 0.0, NEAR_TIE_ABS_TOL, allowed_divergences(len(prompts)))
    for d in verdict["divergences"]:
        if not d["near_tie"]:
            ref, ours, step = references[d["prompt"]], outputs[d["prompt"]], d["step"]
            raise AssertionError(f"diverged at step {step} without a near-tie: reference {ref[:step + 3]} "
                                 f"ours {ours[:step + 3]}")
    if not verdict["ok"]:
        raise AssertionError(f"{len(verdict['divergences'])} near-tie divergences in {len(prompts)}")
    return [d["step"] for d in verdict["divergences"]]


@torch.inference_mode()
def next_token_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids], device=hf_model.device)).logits[0, -1].float()


@torch.inference_mode()
def _generate(hf_model, prompt: list[int], max_new_tokens: int, **kwargs):
    ids = torch.tensor([prompt], device=hf_model.device)
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of one prompt (stops at the generation config's EOS, if it has one)."""
    return _generate(hf_model, prompt, max_new_tokens)[0, len(prompt):].tolist()


def hf_greedy_with_logits(hf_model, prompts: list[list[int]],
                          max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt alone: transformers' greedy tokens, and its raw logits at each step ([steps, vocab], fp32, CPU)."""
    tokens, logits = [], []
    for prompt in prompts:
        out = _generate(hf_model, prompt, max_new_tokens, output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float().cpu())
    return tokens, logits
