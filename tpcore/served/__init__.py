"""The served runtime: a split model served from the caller's own process, one call at a time.

The walk of one served call, caller to rank and back, all in this folder:

1. :mod:`.launch` started the ranks and gave each its shard (from the caller's model, or read by each rank from a
   checkpoint, :func:`.rank_side.load_shard` / :func:`.rank_side.read_shard`).
2. :mod:`.handle`: the caller's model runs ``forward`` on the ranks. :class:`.call.CallerState` writes the
   :class:`.call.Call`: the inputs, and each piece of per-call state written by its codec (:mod:`.caches`,
   :mod:`.kept_tensors`, :mod:`.config_changes`, :mod:`.random_state`).
3. On every rank, :func:`.lookahead.serve` (the wrapper) answers from a guessed step or calls
   :func:`.rank_side.serve`, where :class:`.call.RankState` resolves the call and the forward runs; rank 0 sends
   the output, the reporting rank the random state and the caches' states.
4. Back in the caller, :meth:`.call.CallerState.read` takes the state and turns each cache into its stand-in.

:mod:`.cache_batches` holds the batch operations on caches that a serving engine needs; :mod:`.caller_threads` the
caller's torch threads while the ranks compute.
"""
