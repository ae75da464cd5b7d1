"""RankPool: results, fault injection (raise, kill, hang, intruders), threads, clean shutdown, where it listens.

A fault is proven detected by its error (type and message), not by a time bound; the time each took
is recorded for the summary (``time_to_error``).
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from multiprocessing.connection import Connection

import pytest
import rank_helpers
import torch
from process_probes import children, gone, is_loopback, listening_of

import tpcore
from tpcore.ranks import handshake, process, wire, worker, zygote
from tpcore.ranks.distributed import free_port, interface_of
from tpcore.ranks.process import RankPool, WorkerDiedError, WorkerError

pytestmark = pytest.mark.slow  # fault injection: nearly every test starts (and breaks) worlds of its own


@pytest.fixture
def pool():
    """A fresh 2-rank gloo pool per test (fault injection breaks it), closed after."""
    with RankPool(2, "gloo") as pool:
        yield pool


def test_runs_on_every_rank_and_reduces(pool):
    assert [r[:2] for r in pool.run(rank_helpers.whoami)] == [(0, 2), (1, 2)]
    assert pool.run(rank_helpers.all_reduce_sum, 10) == [21.0, 21.0]
    assert pool.run(rank_helpers.all_reduce_sum, value=1) == [3.0, 3.0]  # pool stays usable


def test_worker_exception_comes_back_with_type_message_and_traceback(pool):
    with pytest.raises(WorkerError) as caught:
        pool.run(rank_helpers.raise_on, 1, "no such tensor")
    error = caught.value
    assert (error.rank, error.type_name) == (1, "KeyError")
    assert isinstance(error.exception, KeyError) and "no such tensor" in str(error)
    assert "raise_on" in error.remote_traceback
    assert error.pool_consistent and pool.alive  # every rank answered: the pool stays usable
    assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]


def test_a_rank_that_fails_while_others_wait_in_a_collective_tears_the_pool_down(pool, time_to_error):
    pids = pool.pids
    started = time.monotonic()
    with pytest.raises(WorkerError, match="bad input on one rank") as caught:
        pool.run(rank_helpers.raise_or_reduce, 0, timeout=300)  # waited out, it would be a TimeoutError
    time_to_error("one rank raises, the other waits in a collective", time.monotonic() - started)
    assert not caught.value.pool_consistent and not pool.alive
    pool.close()  # waits for the stop that began as the call failed
    assert all(gone(pid) for pid in pids)
    with pytest.raises(WorkerDiedError, match="closed"):
        pool.run(rank_helpers.whoami)


def test_killed_worker_is_detected_not_waited_out_and_logged(pool, time_to_error, caplog):
    pid = pool.pids[1]
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        pool.run(rank_helpers.kill_on, 1, timeout=300)
    time_to_error("a rank killed mid-call", time.monotonic() - started)
    assert not pool.alive
    deaths = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert deaths == [("tpcore.process", "ERROR", f"rank 1 (pid {pid}) was killed by SIGKILL during kill_on")]


def test_every_wait_has_a_timeout(pool, time_to_error):
    pids = pool.pids
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 1 s"):
        pool.run(rank_helpers.sleep, 30, timeout=1)
    time_to_error("a call past its 1 s timeout", time.monotonic() - started)
    pool.close()  # waits for the stop that began as the call failed
    assert all(gone(pid) for pid in pids)


def test_a_call_s_timeout_raises_at_its_deadline_and_the_ranks_stop_after(pool, time_to_error):
    """``timeout=5`` on a stuck call: the ``TimeoutError`` comes at the deadline, before the pool's stop is done.
    Rank 0 answered but takes 20 s to stop (it may have much to release); rank 1 is stuck, and is killed at once.
    The pool reads as closed from the raise on; ``close()`` waits for the stop (``STOP_GRACE_S``, then a kill)."""
    pids = pool.pids
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] gave no answer within 5 s"):
        pool.run(rank_helpers.stopping_slowly_or_stuck, 20, timeout=5)
    elapsed = time.monotonic() - started
    time_to_error("a stuck call with timeout=5", elapsed)
    assert not gone(pids[0]), "the error waited for the pool's stop"
    assert elapsed < 5 + process.STOP_GRACE_S  # measured: 5.0 s (8.1 s when the stop came first)
    with pytest.raises(WorkerDiedError, match="closed"):
        pool.run(rank_helpers.whoami)
    pool.close()
    assert all(gone(pid) for pid in pids)


def test_calls_from_threads_are_serialized_and_each_gets_its_own_result(pool):
    results = {}

    def call(value):
        results[value] = pool.run(rank_helpers.all_reduce_sum, value)

    threads = [threading.Thread(target=call, args=(value,)) for value in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {value: [2.0 * value + 1] * 2 for value in range(8)}


def test_neither_rank_0_nor_the_caller_keeps_a_finished_call_s_tensors(pool):
    """200 calls of 4 MiB in and out, garbage collection off on both sides: once a call is done, its input (in
    the caller and on each rank) and its output (on rank 0 and, once dropped, in the caller) are freed. Nothing
    holds them in a reference cycle, such as a message pickler whose ``buffer_callback`` is its own method."""
    nbytes, calls = 4 * 2**20, 200
    pool.run(rank_helpers.garbage_collection, False)
    gc.disable()
    try:
        watched: list[weakref.ref] = []
        for call in range(calls):
            inputs = torch.ones(nbytes, dtype=torch.uint8)
            (alive_on_rank_0, output), (alive_on_rank_1, _) = pool.run(rank_helpers.watched_output, inputs, nbytes)
            assert (alive_on_rank_0, alive_on_rank_1) == (0, 0), f"call {call}: earlier tensors alive on the ranks"
            assert output.shape == (nbytes,)
            watched += [weakref.ref(inputs), weakref.ref(output)]
            del inputs, output
            assert not [ref for ref in watched if ref() is not None], f"call {call}: tensors alive in the caller"
    finally:
        gc.enable()
        pool.run(rank_helpers.garbage_collection, True)


def test_close_leaves_no_process_and_frees_the_port():
    port = free_port()
    pool = RankPool(2, "gloo", master_port=port)
    pids = [pid for *_, pid in pool.run(rank_helpers.whoami)]
    pool.close()
    pool.close()  # idempotent
    assert all(gone(pid) for pid in pids)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # fails while anything still listens there


def test_a_rank_that_cannot_start_fails_fast_and_leaves_nothing(monkeypatch, time_to_error):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "tpcore-no-such-if")  # the ranks' gloo cannot open its sockets
    before = children()
    started = time.monotonic()
    with pytest.raises(WorkerError, match="Unable to find address for: tpcore-no-such-if"):
        RankPool(2, "gloo", start_timeout=300)  # waited out, it would be a TimeoutError
    time_to_error("a rank fails to join its group", time.monotonic() - started)
    assert children() <= before


def test_functions_and_classes_defined_in_main_travel_by_value(pool, monkeypatch):
    """As in a notebook: the ranks cannot import ``__main__``, so cloudpickle sends code by value."""
    import __main__

    def answer(context, offset):
        return context.rank + offset

    answer.__module__ = "__main__"
    monkeypatch.setattr(__main__, "answer", answer, raising=False)
    assert pool.run(answer, 40) == [40, 41]


def test_the_c_pickler_pickles_a_message_and_cloudpickle_only_one_with_code_to_send_by_value(monkeypatch):
    """A served call and its reply hold importable code only: the C pickler, at half cloudpickle's cost. Code the
    ranks cannot import (from ``__main__``, or a class made at run time under an importable class's name) is
    found by the C pickler and the message goes to cloudpickle, which sends it by value."""
    import pickle

    import __main__

    used = []
    for name in ("_Pickler", "_CodePickler"):
        pickler = getattr(wire, name)

        def dump(self, obj, _name=name, _dump=pickler.dump):
            used.append(_name)
            return _dump(self, obj)

        monkeypatch.setattr(wire, name, type(name, (pickler,), {"dump": dump}))

    def pickled(message):
        used.clear()
        return pickle.loads(wire.encode(message).frames[0])[0]

    call = (rank_helpers.echo, (torch.arange(3), {"mask": torch.ones(2, 2)}), {}, logging.INFO)
    assert pickle.loads(pickled(call))[0] is rank_helpers.echo and used == ["_Pickler"]

    def answer(context):
        return 42

    answer.__module__ = "__main__"
    monkeypatch.setattr(__main__, "answer", answer, raising=False)
    pickled((answer, (), {}, logging.INFO))
    assert used == ["_Pickler", "_CodePickler"]  # by reference it would name a __main__ the ranks do not have

    made_at_run_time = type("Tensor", (torch.Tensor,), {"__module__": "torch"})  # like tpcore's served classes
    assert pickle.loads(pickled(made_at_run_time)) is made_at_run_time and used == ["_Pickler", "_CodePickler"]


def test_large_tensors_travel_out_of_band_and_come_back_exact_and_writable(pool):
    import pickle

    from tpcore.ranks.wire import SHARED_TENSOR_BYTES, encode

    tensors = [
        torch.randn(3, 128, 1000),  # logits-sized: shared memory
        torch.randn(400, 300).T,  # non-contiguous: a raw frame
        torch.ones(70_000, dtype=torch.bfloat16),  # a dtype numpy lacks: a raw frame
        torch.arange(5),  # small: stays in the pickle
    ]
    assert tensors[0].numel() * 4 >= SHARED_TENSOR_BYTES > tensors[1].numel() * 4
    with encode(tensors) as message:
        payload, places, fd_count, _ = pickle.loads(message.frames[0])
        assert [place[0] for place in places] == ["fd", "frame", "frame"] and fd_count == len(message.fds) == 1
        assert len(message.frames) == 3 and len(payload) < 4096  # the big bytes are not in the pickled frame
    back = pool.run(rank_helpers.echo, *tensors)[0]  # in shared memory both ways
    for original, received in zip(tensors, back, strict=True):
        assert received.dtype == original.dtype and torch.equal(received, original)
    back[0].add_(1)  # its own writable memory
    # Both ranks map one segment of the inputs, each copy-on-write: rank 1's change stays its own.
    unchanged, changed = pool.run(rank_helpers.change_on_rank_one_then_echo, tensors[0])
    assert torch.equal(unchanged, tensors[0]) and torch.equal(changed, tensors[0] + 1)


def test_small_tensors_travel_as_their_bytes_not_through_torch_serialization(monkeypatch):
    """A small call's inputs, outputs and random state cost microseconds: no torch.save per tensor. What
    cannot travel as bytes (autograd, a lazy conjugate) still goes torch's way."""
    import threading
    from multiprocessing import Pipe

    plain = [
        torch.tensor(3.5),
        torch.arange(6, dtype=torch.int64).view(2, 3),
        torch.ones(2, 3, dtype=torch.bfloat16),
        torch.arange(10)[::2],  # non-contiguous
        torch.tensor([True, False]),
        torch.get_rng_state(),
        torch.zeros(0, 4),
        torch.ones(3, dtype=torch.int8).expand(2, 3),  # a stride of 0
    ]
    torch_way = [torch.ones(2, requires_grad=True), torch.randn(3, dtype=torch.complex64).conj()]
    reduced = []
    original_reduce = torch.Tensor.__reduce_ex__

    def counting_reduce(tensor, protocol):
        reduced.append(tensor)
        return original_reduce(tensor, protocol)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counting_reduce)
    sender, receiver = Pipe()
    sending = threading.Thread(target=wire.send, args=(sender, plain + torch_way))
    sending.start()
    back = wire.recv(receiver)
    sending.join()
    assert len(reduced) == len(torch_way) and all(any(r is t for r in reduced) for t in torch_way)
    for original, received in zip(plain + torch_way, back, strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received.detach().resolve_conj(), original.detach().resolve_conj())
    back[1].add_(1)  # its own writable memory
    assert torch.equal(back[1], plain[1] + 1)


def test_gathered_outputs_travel_in_shared_memory_reused_call_after_call_and_large_ones_in_their_own(pool):
    """A served step's gathered logits: written into the same segment at every call (no new pages), copied out by
    the caller, so that an earlier call's result is not overwritten by the next; past memfd.REUSED_MAX_BYTES a
    segment of its own, which the caller maps."""
    from tpcore.parallel import memfd

    rows = memfd.GATHERED_MIN_BYTES // (4 * 64)  # the gathered (rows, 128) pass memfd.GATHERED_MIN_BYTES

    def expected(offset):
        return torch.cat([torch.full((rows, 64), rank + offset) for rank in range(2)], dim=-1)

    first = pool.run(rank_helpers.gather_rows_into_shared_memory, rows, 0.0)
    second = pool.run(rank_helpers.gather_rows_into_shared_memory, rows, 10.0)
    for (gathered, segment), (again, segment_again) in zip(first, second, strict=True):
        assert segment.reused and segment_again.reused
        assert segment_again.fd == segment.fd  # the same segment, free again once the first result was sent
        assert torch.equal(gathered, expected(0.0)) and torch.equal(again, expected(10.0))
    own = pool.run(rank_helpers.gather_rows_into_shared_memory, rows, 0.0, reused_max=1024)
    for gathered, segment in own:
        assert segment is not None and not segment.reused
        assert torch.equal(gathered, expected(0.0))


def test_run_first_returns_rank_0_s_result_and_the_next_call_raises_a_later_failure(pool):
    """The other ranks' answers to a run_first are read with the next call: a rank that failed after rank 0
    answered is reported there, every rank having answered, and the pool goes on."""
    assert pool.run_first(rank_helpers.fail_on_rank_one_after_rank_zero_answered) == "rank 0's result"
    with pytest.raises(WorkerError, match="rank 1 failed after the others answered") as caught:
        pool.run(rank_helpers.whoami)
    assert caught.value.rank == 1 and caught.value.pool_consistent and pool.alive
    assert [result[:2] for result in pool.run(rank_helpers.whoami)] == [(0, 2), (1, 2)]
    assert pool.run_first(rank_helpers.all_reduce_sum, 1) == 3.0
    assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]  # the owed answer read, not taken for this one


def test_run_some_returns_the_results_of_the_ranks_asked_for_and_the_next_call_reads_the_others(pool):
    assert [result[:2] for result in pool.run_some(rank_helpers.whoami, ranks=[1, 0])] == [(1, 2), (0, 2)]
    assert pool.run_some(rank_helpers.all_reduce_sum, 1, ranks=[1]) == [3.0]
    assert pool.run(rank_helpers.all_reduce_sum, 2) == [5.0, 5.0]  # rank 0's owed answer read, not taken for this


def test_a_rank_that_dies_after_a_run_first_fails_the_next_call(pool):
    pid = pool.pids[1]
    assert pool.run_first(rank_helpers.whoami)[0] == 0
    os.kill(pid, 9)
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        pool.run(rank_helpers.whoami)
    assert not pool.alive


def test_only_cpu_tensors_have_a_byte_view_and_a_cuda_rank_waits_for_its_kernels_before_replying(monkeypatch):
    with pytest.raises(ValueError, match="needs a CPU tensor, got one on meta"):
        wire.byte_view(torch.ones(3, device="meta"))
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    worker.synchronize(torch.device("cpu"))
    worker.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_a_rank_reads_the_arguments_its_command_line_was_given(monkeypatch):
    """The caller's side (:func:`worker_command`) and the rank's (:func:`worker_entry`) agree on the argv."""
    received = []
    monkeypatch.setattr(worker, "_worker_main", lambda *args: received.append(args))
    command = worker.worker_command("/tmp/socket", 1, 2, "gloo", "cpu", "127.0.0.1", 29500, 3)
    assert command[:3] == [sys.executable, "-c", worker.WORKER_CODE]
    worker.worker_entry(command[3:])
    preloading = worker.worker_command("/tmp/socket", 0, 2, "nccl", "cuda", "::1", 29500, 1, ["json", "a.b"])
    worker.worker_entry(preloading[3:])
    assert received == [
        ("/tmp/socket", 1, 2, "gloo", "cpu", "127.0.0.1", 29500, 3, ()),
        ("/tmp/socket", 0, 2, "nccl", "cuda", "::1", 29500, 1, ("json", "a.b")),
    ]


def test_a_rank_s_context_calls_its_group_tp_group_and_keeps_the_earlier_name():
    context = worker.RankContext(0, 1, "gloo", "the group", "cpu")
    assert context.tp_group == context.tp_group == "the group"


def test_the_names_callers_import_from_tpcore_process_are_the_rank_side_s_own():
    from tpcore.ranks import failures

    assert process.RankContext is worker.RankContext
    assert process.WorkerError is failures.WorkerError and process.WorkerDiedError is failures.WorkerDiedError
    assert process.reraise is failures.reraise
    assert set(process.__all__) == {"RankContext", "RankPool", "WorkerDiedError", "WorkerError", "reraise"}


# -- where the ranks listen, and who may talk to them -------------------------------------------


def test_the_rendezvous_and_the_ranks_listen_on_loopback_only():
    """The store (served by the caller), gloo's pairs and anything else the ranks open: loopback, never ``::``."""
    before = listening_of([os.getpid()])  # stores of pools other tests keep alive
    with RankPool(2, "gloo") as pool:
        listening = listening_of([os.getpid(), *pool.pids])
        assert ("127.0.0.1", pool.master_port) in listening.values()
        assert listening and all(is_loopback(address) for address, _ in listening.values()), listening
        assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]
    after = listening_of([os.getpid()])  # a pool another test left to the collector may close meanwhile
    assert after.items() <= before.items(), "the store outlived its pool"


SPMD_WITHOUT_TORCHRUN = textwrap.dedent(
    """
    import json, os
    import torch
    import torch.distributed as dist
    from process_probes import listening_of
    from tpcore.ranks.distributed import tensor_parallel_group

    group = tensor_parallel_group(2, "gloo")
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"sum": total.item(), "listening": list(listening_of([os.getpid()]).values())}))
    dist.barrier(group=group)
    """
)


def test_a_world_joined_from_master_addr_without_torchrun_listens_there_only(tmp_path):
    """``tensor_parallel_group`` under hand-set RANK/WORLD_SIZE/MASTER_*: rank 0's store binds MASTER_ADDR alone."""
    script = tmp_path / "spmd.py"
    script.write_text(SPMD_WITHOUT_TORCHRUN)
    port = free_port()
    path = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])  # tests/: process_probes
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "PYTHONPATH": path}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, **world, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    report = json.loads(outputs[0])
    assert report["sum"] == 2.0
    assert ["127.0.0.1", port] in report["listening"], report
    assert all(is_loopback(address) for address, _ in report["listening"]), report


def _intrude(address: str, how: str) -> socket.socket:
    """Connect to a pool's control socket as a stray local client would."""
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    intruder.connect(address)
    if how == "garbage":
        intruder.sendall(os.urandom(handshake._REPLY_BYTES))
    elif how == "wrong key":
        challenge = intruder.recv(handshake.CHALLENGE_BYTES)
        rank = (0).to_bytes(4, "big")
        intruder.sendall(hmac.new(b"not the key", challenge + rank, hashlib.sha256).digest() + rank)
    elif how == "half an answer":
        intruder.sendall(b"\x00" * 5)
    return intruder  # "silent": connected, sends nothing, stays open


def test_stray_connections_to_the_control_socket_are_dropped_and_the_ranks_still_join(monkeypatch, time_to_error):
    """Silent, garbage, wrong-key and half-answer clients connect before the ranks do and stay connected:
    the pool starts anyway, within its start timeout, and drops them."""
    intruders: list[socket.socket] = []
    listeners: list[handshake.ControlListener] = []

    class IntrudedListener(handshake.ControlListener):
        def accept_ranks(self, *args, **kwargs):
            listeners.append(self)
            kinds = ("silent", "garbage", "wrong key", "half an answer")
            # beside the accept loop: the wrong-key client waits for its challenge
            threading.Thread(target=lambda: intruders.extend(_intrude(self.address, how) for how in kinds)).start()
            return super().accept_ranks(*args, **kwargs)

    monkeypatch.setattr(process, "ControlListener", IntrudedListener)
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 1.0)
    started = time.monotonic()
    try:
        # 300 s: ample on a loaded machine; a start blocked by the silent client would end in TimeoutError
        with RankPool(2, "gloo", start_timeout=300) as pool:
            time_to_error("start with 4 stray clients connected", time.monotonic() - started)
            assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]
            assert listeners[0].dropped == 4
    finally:
        for intruder in intruders:
            intruder.close()
    assert not os.path.exists(listeners[0].address)  # the socket and its directory are removed


def test_the_control_socket_is_private_to_the_user():
    with handshake.ControlListener() as listener:
        assert os.stat(os.path.dirname(listener.address)).st_mode & 0o777 == 0o700


def test_ranks_that_never_connect_fail_the_start_at_its_timeout(monkeypatch, time_to_error):
    """Ranks that hang before connecting: the start gives up at ``start_timeout`` (here 3 s), not at its default."""
    monkeypatch.setenv(zygote.START_ENV, "spawn")  # fresh interpreters, running the code set here
    monkeypatch.setattr(worker, "WORKER_CODE", "import time; time.sleep(120)")
    before = children()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not connect"):
        RankPool(2, "gloo", start_timeout=3)
    time_to_error("ranks hang before connecting, start_timeout=3", time.monotonic() - started)
    assert children() <= before


def test_parallelize_passes_its_timeout_to_the_start(monkeypatch):
    monkeypatch.setenv(zygote.START_ENV, "spawn")  # fresh interpreters, running the code set here
    monkeypatch.setattr(worker, "WORKER_CODE", "import time; time.sleep(120)")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    class Whole(tpcore.Policy):
        layer_class = torch.nn.Linear

    with pytest.raises(TimeoutError, match="did not connect"):
        tpcore.parallelize(model, num_gpus=2, backend="gloo", custom_policies=[Whole], timeout=3)
    assert "forward" not in vars(model)


def test_a_broken_pipe_to_a_rank_is_a_dead_rank(pool):
    """An ``OSError`` while sending (the rank's end is gone) is a :class:`WorkerDiedError`, and the pool closes."""
    mine, theirs = socket.socketpair()
    theirs.close()
    real = pool._conns[1]
    pool._conns[1] = Connection(mine.detach())
    try:
        with pytest.raises(WorkerDiedError, match="rank 1"):
            pool.run(rank_helpers.whoami)
    finally:
        real.close()
    assert not pool.alive


def test_ranks_run_in_their_own_session_with_their_own_world(monkeypatch):
    """A terminal's Ctrl-C goes to the caller's process group only; an outer launcher's variables stay out."""
    for name, value in {"RANK": "5", "LOCAL_RANK": "5", "WORLD_SIZE": "8", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with RankPool(2, "gloo") as pool:
        sessions = {os.getsid(pid) for pid in pool.pids}
        assert os.getsid(0) not in sessions and len(sessions) == 2
        assert pool.run(rank_helpers.environment_variable, "LOCAL_RANK") == [None, None]
        if "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo's sockets on the loopback interface, too
            loopback = interface_of("127.0.0.1")
            assert pool.run(rank_helpers.environment_variable, "GLOO_SOCKET_IFNAME") == [loopback, loopback]


def test_a_busy_master_port_fails_before_any_rank_starts():
    before = children()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            RankPool(2, "gloo", master_port=port)
    assert children() <= before


def test_the_exceptions_a_user_catches_are_importable_from_tpcore():
    from tpcore.select import plugins

    assert tpcore.WorkerError is WorkerError and tpcore.WorkerDiedError is WorkerDiedError
    assert tpcore.PluginLoadWarning is plugins.PluginLoadWarning
    assert tpcore.PluginConflictError is plugins.PluginConflictError
    assert {"WorkerError", "WorkerDiedError", "ShardingError", "UnsupportedModelError"} <= set(tpcore.__all__)


# -- the caller's side: a forked child, a kill during the start, the start method ------------------

FORKING_CALLER = textwrap.dedent(
    """
    import io, json, multiprocessing, os, sys
    import torch, tpcore
    from tpcore.testing import tiny_bert

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model = tiny_bert(seed=None)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    stderr, sys.stderr = sys.stderr, Terminal()  # the load bar is shown, as on a terminal
    tpcore.parallelize(model, num_gpus=2, backend="gloo")
    screen, sys.stderr = sys.stderr, stderr
    report = {
        "bar shown": "ranks loaded: 100%" in screen.getvalue(),
        "start method": multiprocessing.get_start_method(allow_none=True),
    }


    def child(how):
        if how == "os._exit":
            os._exit(0)
        if how == "calls the model, deparallelizes, exits":
            refused = False
            try:
                model(input_ids=ids)
            except tpcore.WorkerDiedError as error:
                refused = "forked from" in str(error)
            model.deparallelize()
            sys.exit(0 if refused else 3)
        sys.exit(0)  # the interpreter's exit: atexit hooks, then finalizers


    for how in ("os._exit", "exits", "calls the model, deparallelizes, exits"):
        pid = os.fork()
        if pid == 0:
            child(how)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        try:
            same = torch.allclose(model(input_ids=ids).last_hidden_state, expected, atol=1e-5)
            report[how] = [code, "the parent's call works" if same else "the parent's call differs"]
        except Exception as error:
            report[how] = [code, f"{type(error).__name__}: {error}"]
    try:
        multiprocessing.set_start_method("spawn")
        report["set_start_method"] = "set"
    except RuntimeError as error:
        report["set_start_method"] = str(error)
    model.deparallelize()
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def forking_caller(tmp_path_factory) -> dict:
    """What a fresh caller saw: ``parallelize()`` with its bar shown, then a child forked from it three times."""
    script = tmp_path_factory.mktemp("forking") / "caller.py"
    script.write_text(FORKING_CALLER)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_forked_child_that_exits_leaves_its_parent_s_ranks_alone(forking_caller):
    """A child of ``os.fork()`` (a preloading server's worker, a ``DataLoader`` worker) inherits the pool, its
    connections and the exit hook: whether it exits at once, through the interpreter's exit (atexit hooks,
    finalizers) or after calling the model (refused) and deparallelizing, the parent's next call works."""
    works = "the parent's call works"
    assert forking_caller["os._exit"] == [0, works]
    assert forking_caller["exits"] == [0, works]
    assert forking_caller["calls the model, deparallelizes, exits"] == [0, works]


def test_parallelize_and_its_load_bar_leave_the_start_method_unset(forking_caller):
    """tqdm's first bar made a process lock, which fixed the global start method; after ``parallelize()`` with
    the bar shown, ``multiprocessing.set_start_method()`` is still the caller's to call."""
    assert forking_caller["bar shown"]
    assert forking_caller["start method"] is None
    assert forking_caller["set_start_method"] == "set"


KILLED_DURING_START = textwrap.dedent(
    """
    import json
    from tpcore.ranks.process import RankPool

    pool = RankPool(2, "gloo", wait=False)
    print(json.dumps({"pids": pool.pids, "address": pool._listener.address}), flush=True)
    pool.wait_started()
    """
)


def test_a_caller_killed_while_its_ranks_start_leaves_no_rank_and_no_control_socket(time_to_error):
    """SIGKILL 0.2 s after the ranks spawned, while they still import torch: each watches its caller from the first
    line of its interpreter (``tests/ranks/test_worker.py``), so they end within a poll or two (measured: 0.4-0.6 s;
    they lived 3-8 s when the watch began after the imports), and they remove the control socket and its directory,
    which the killed caller cannot."""
    caller = subprocess.Popen([sys.executable, "-c", KILLED_DURING_START], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(caller.stdout.readline())
        time.sleep(0.2)
    finally:
        caller.kill()
        killed = time.monotonic()
        caller.wait()
    while not all(gone(pid) for pid in started["pids"]) and time.monotonic() - killed < 60:
        time.sleep(0.01)
    lifetime = time.monotonic() - killed
    time_to_error("ranks outliving their caller, SIGKILLed 0.2 s into the start", lifetime)
    assert all(gone(pid) for pid in started["pids"])
    assert lifetime < 10  # a bound no loaded machine reaches; the mechanism is proven in tests/ranks/test_worker.py
    assert not os.path.exists(os.path.dirname(started["address"]))
