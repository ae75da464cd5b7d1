"""A probe of a design not built into tpcore: the ranks compute the next greedy decode step while the caller runs
generate's own work, and answer the caller's next call from it when that call is the one they guessed.

In the caller's loop (``generation.py``) every step is serial: the ranks' forward, the reply, generate's own work in
the caller (logits processors, stopping criteria, streamer: 1.5-2.6 ms here), the next call. Here, once a rank has
answered a decode-shaped call (input ids and a cache, nothing else changed), every rank takes the greedy guess
(the argmax of the last position's gathered logits, the same on every rank) and runs the forward the caller's next
call would ask for: the guessed token, the positions one further, everything else as before, on the same cache.
When the next call comes with exactly those inputs, the stored output answers it; otherwise the cache drops the
guessed position (``crop(-1)``) and the call runs as usual. Greedy ``generate()`` gives the caller's tokens either
way (checked against the ranks' own loop every run).

This is a probe: it wraps ``tpcore.rank_side.serve`` (which a call's pickle names, so the wrapper is what the ranks
run) and ``tpcore.ranks.worker.recv`` (the guessed forward runs just before a rank waits for its next call) on the
served model's ranks, for greedy decoding only; the stored output goes back through the socket, not the shared
segment. Three loops, interleaved in rounds as in ``generation.py``: the ranks' own loop, the caller's loop, and the
caller's loop with the lookahead; ms/token ``(time with T new tokens - time with 1) / (T - 1)``, and each round's
ratio against the ranks' loop (median and range), with how many guessed forwards answered a call.

    python bench/lookahead.py                                       # N=2 ranks sharing 2 cores with the caller
    python bench/lookahead.py --ranks 1 --threads-per-rank 1        # a core to spare for the caller
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from _common import common_arguments, markdown_table, plain_table, write_result
from generation import (
    caller_generate,
    paired_ratios,
    per_token_ms,
    prompts,
    ranks_generate,
    ranks_load,
    spec_for,
)

import tpcore
from tpcore.ranks.process import RankPool

# --- run on the served model's ranks (module-level, so cloudpickle sends them by value) -----------------------


def _predicted(kwargs: dict, guess: torch.Tensor) -> dict:
    """The keyword arguments of the decode call after ``kwargs`` if the caller takes ``guess`` (batch,)."""
    from tpcore.rank_cache import CacheRef

    following = {}
    for key, value in kwargs.items():
        if key == "input_ids":
            value = guess[:, None].to(value.dtype)
        elif key == "position_ids":
            value = value[:, -1:] + 1
        elif key == "cache_position":
            value = value[-1:] + 1
        elif key == "attention_mask":
            value = torch.cat([value, value.new_ones(value.shape[0], 1)], dim=-1)
        elif isinstance(value, CacheRef):
            value = CacheRef(value.id)
        following[key] = value
    return following


def _same(expected: dict, got: dict) -> bool:
    if expected.keys() != got.keys():
        return False
    for key, value in expected.items():
        other = got[key]
        if torch.is_tensor(value):
            equal = torch.is_tensor(other) and value.dtype == other.dtype and value.shape == other.shape
            if not (equal and torch.equal(value, other)):
                return False
        elif value != other:  # a CacheRef: the same id, no template
            return False
    return True


def _decode_shaped(call) -> bool:
    from tpcore.rank_cache import CacheRef

    kwargs = call.kwargs
    cache_sent = any(isinstance(value, CacheRef) for value in kwargs.values())
    return not (call.path or call.args or call.config_changes or call.method) and "input_ids" in kwargs and cache_sent


def set_lookahead(context, on: bool) -> dict[str, int]:
    """On a rank: the lookahead on or off (a pending guess dropped); the counts of guesses run and used so far."""
    import tpcore.rank_side as rank_side
    import tpcore.ranks.worker as worker

    store = context.store
    if "lookahead" not in store:
        store["lookahead"] = {"serve": rank_side.serve, "recv": worker.recv, "run": 0, "used": 0}
        store["model"].register_forward_hook(_keep_guess(store))
    state = store["lookahead"]
    pending = state.pop("pending", None)
    if pending is not None:
        pending[1].crop(-1)
    state.pop("next", None)
    rank_side.serve, worker.recv = (_serve(state), _recv(state, store)) if on else (state["serve"], state["recv"])
    return {"run": state["run"], "used": state["used"]}


def _keep_guess(store):
    def hook(module, args, output):
        if store["lookahead"].get("capture") and getattr(output, "logits", None) is not None:
            store["lookahead"]["guess"] = output.logits[:, -1].argmax(-1)

    return hook


class _Stored(torch.nn.Module):
    def __init__(self, output) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


def _serve(state):
    def serve(context, call):
        model, pending = context.store["model"], state.pop("pending", None)
        decode = _decode_shaped(call)
        if pending is not None and decode and not call.freed and _same(pending[0], call.kwargs):
            state["used"] += 1
            context.store["model"] = _Stored(pending[2])
            try:
                result = state["serve"](context, call)
            finally:
                context.store["model"] = model
            guess = pending[2].logits[:, -1].argmax(-1)
        else:
            if pending is not None:
                pending[1].crop(-1)
            state["capture"], state["guess"] = decode, None
            try:
                result = state["serve"](context, call)
            finally:
                state["capture"] = False
            guess = state.pop("guess", None)
        if decode and guess is not None:
            state["next"] = _predicted(call.kwargs, guess)
        return result

    return serve


def _recv(state, store):
    def recv(conn):
        predicted = state.pop("next", None)
        if predicted is not None:
            inputs = store["caches"].resolve(predicted)
            cache = next(value for value in inputs.values() if hasattr(value, "crop"))
            with torch.inference_mode():
                state["pending"] = (predicted, cache, store["model"](**inputs))
            state["run"] += 1
        return state["recv"](conn)

    return recv


def settle(context) -> None:
    """Nothing: a call that waits for a guessed forward still running after a ``generate()`` (outside the timing)."""


def _reset_counts(context) -> None:
    state = context.store.get("lookahead")
    if state is not None:
        state["run"] = state["used"] = 0


# --- caller side ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "lookahead", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads-per-rank", type=int, default=None)
    args = parser.parse_args(argv)
    new_tokens, rounds, layers = (6, 1, 2) if args.quick else (args.new_tokens, args.rounds, args.layers)
    spec = spec_for(layers)
    served = tpcore.parallelize(spec.build(), num_gpus=args.ranks, threads_per_rank=args.threads_per_rank)
    served_pool = served._tpcore_handle.pool
    rows = []
    with RankPool(args.ranks, "gloo", threads_per_rank=args.threads_per_rank) as pool:
        pool.run(ranks_load, spec)
        for batch in (1, 8):
            inputs = prompts(batch)
            times = {way: {1: [], new_tokens: []} for way in ("ranks", "caller", "lookahead")}
            for round_ in range(rounds + 1):  # the first round warms up
                for count in (1, new_tokens):
                    seconds, tokens = pool.run(ranks_generate, inputs, count)[0]
                    times["ranks"][count].append(seconds)
                    for way in ("caller", "lookahead") if round_ % 2 else ("lookahead", "caller"):
                        served_pool.run(set_lookahead, way == "lookahead")
                        seconds, caller_tokens = caller_generate(served, inputs, count)
                        times[way][count].append(seconds)
                        served_pool.run(settle)
                        assert torch.equal(tokens, caller_tokens), f"{way}: the caller's tokens differ"
            counts = served_pool.run(set_lookahead, False)[0]
            served_pool.run(_reset_counts)
            ms = {way: per_token_ms(t[new_tokens][1:], t[1][1:], new_tokens) for way, t in times.items()}
            row = [str(batch), f"{ms['ranks']:.2f}"]
            for way in ("caller", "lookahead"):
                ratios = paired_ratios(times, way, new_tokens)
                row += [f"{ms[way]:.2f}", f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"]
            rows.append([*row, f"{counts['used']}/{counts['run']}"])
    served.deparallelize()
    header = [
        "batch",
        "ranks' loop ms/token",
        "caller's loop ms/token",
        "caller / ranks (range)",
        "with lookahead ms/token",
        "with lookahead / ranks (range)",
        "guessed forwards used / run",
    ]
    print(plain_table(header, rows))
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.ranks)
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N={args.ranks} gloo ranks of {threads} intra-op "
        f"thread(s) each, {os.cpu_count()} CPU cores, greedy, {new_tokens} new tokens after a 16-token prompt, "
        f"{rounds} rounds. ms/token: from the medians of the rounds; ratios: the median of the rounds' own.",
        markdown_table(header, rows),
    ]
    write_result(
        "lookahead", "Decode ms/token with the ranks guessing the next step", sections, "gloo", args.note, args.output
    )


if __name__ == "__main__":
    main()
