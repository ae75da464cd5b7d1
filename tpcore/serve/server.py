"""Starting and stopping the server: the model loaded (split over ranks, or whole), uvicorn on the app, and a
shutdown that leaves no process behind.

uvicorn handles Ctrl-C and SIGTERM: it stops accepting connections and lets the requests in flight finish for up
to ``graceful_s`` seconds; then the engine cancels what is left and the ranks stop (``deparallelize()``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tpcore.serve.app import create_app
from tpcore.serve.service import Limits, NotServable, Service, refuse_unbatchable_cache
from tpcore.serve.spmd import torchrun_world

__all__ = [
    "NotServable",
    "RanksLost",
    "Server",
    "auto_class",
    "free_port",
    "load_model",
    "refuse_unbatchable_cache",
    "serve",
]

logger = logging.getLogger("tpcore.serve")


class RanksLost(RuntimeError):
    """The ranks were lost and the server stopped, for a supervisor to start it again (``exit_on_loss``)."""


def load_model(directory: str, num_gpus: int, dtype: Any = None, compile: bool = False) -> tuple[Any, Any]:
    """The model of ``directory`` split over ``num_gpus`` ranks (shard-on-load), or whole in this process for
    ``num_gpus=0``; and its tokenizer. ``compile``: the ranks' decode step compiled, with the graphs the running
    batch needs made before the server starts (:func:`tpcore.served.compiled.compile_ranks`)."""
    import transformers

    from tpcore.api import parallelize
    from tpcore.serve.batch import warm_ups
    from tpcore.served.compiled import compile_ranks

    config = transformers.AutoConfig.from_pretrained(directory)
    auto, kind = auto_class(config)
    generates = kind == "decoder"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    if compile and (num_gpus == 0 or not generates):
        raise NotServable(
            "--compile compiles the ranks' decode step: it needs a decoder-only model that generates text, split "
            f"over 1 or more ranks (--num-gpus {num_gpus}, {'a decoder' if generates else 'not a decoder'})"
        )
    if num_gpus == 0:
        return auto.from_pretrained(directory, dtype=dtype).eval(), tokenizer
    model = parallelize(directory, num_gpus=num_gpus, dtype=dtype)
    if compile:
        compile_ranks(model, warm_ups=warm_ups())  # on failure the ranks stop before the error is raised
    return model, tokenizer


def auto_class(config: Any) -> tuple[Any, str]:
    """The transformers auto class that loads ``config``'s model, and what it is: ``decoder`` (generates text,
    images read too where it is a vision-language model), ``seq2seq``, ``speech`` or ``encoder``;
    :class:`NotServable` for a model the server cannot serve, known from its config."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    encoder_decoder = getattr(config, "is_encoder_decoder", False) and bool(architectures)
    if encoder_decoder and type(config) in transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForSeq2SeqLM, "seq2seq"
    if encoder_decoder and type(config) in transformers.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING:
        return transformers.AutoModelForSpeechSeq2Seq, "speech"
    if encoder_decoder:
        raise NotServable(
            f"{architectures[0]} is an encoder-decoder of other inputs than text and speech (images): tpcore serve "
            "takes text prompts and audio; split it with tpcore.parallelize() and call generate()"
        )
    if type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        refuse_unbatchable_cache(config, architectures[0] if architectures else type(config).__name__)
        return transformers.AutoModelForImageTextToText, "decoder"
    if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures):
        refuse_unbatchable_cache(config, architectures[0])
        return transformers.AutoModelForCausalLM, "decoder"
    return transformers.AutoModel, "encoder"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Server:
    """``service`` behind uvicorn on ``host:port``: :meth:`run` in the foreground (signals handled), or
    :meth:`start` in a thread and :meth:`stop`."""

    def __init__(
        self,
        service: Service,
        host="127.0.0.1",
        port=8000,
        api_key=None,
        max_body_bytes=1 << 20,
        graceful_s=10,
        exit_on_loss=False,
    ):
        import uvicorn

        _warn_if_exposed(host, api_key)
        self.service = service
        #: why the server stopped on its own: the ranks were lost (``exit_on_loss``)
        self.lost: str | None = None
        if exit_on_loss:
            service.scheduler.when_dead = self._stop_on_loss
        app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=graceful_s, lifespan="off"
        )
        self.uvicorn = _uvicorn_keeping_signals()(config)
        self.url = f"http://{host}:{port}"
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Serve until Ctrl-C or SIGTERM, then stop the engine; :class:`RanksLost` where the server stopped because
        the ranks were lost (``exit_on_loss``)."""
        self.service.start()
        logger.info("serving %s on %s (OpenAI API under /v1)", self.service.name, self.url)
        try:
            self.uvicorn.run()
        finally:
            self.service.stop()
        if self.lost is not None:
            raise RanksLost(self.lost)

    def _stop_on_loss(self, reason: str) -> None:
        """The engine lost the ranks: the requests in flight have their 503; stop listening (uvicorn lets the
        responses under way finish)."""
        self.lost = reason
        self.uvicorn.should_exit = True

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a thread; returns once the port listens."""
        self.service.start()
        self._thread = threading.Thread(target=self.uvicorn.run, name="tpcore-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.service.stop()


def _uvicorn_keeping_signals() -> type:
    """uvicorn's ``Server``, except that a Ctrl-C or SIGTERM it shut down on is not raised again when it returns
    (uvicorn re-raises it, which would end the process before the engine and the ranks are stopped)."""
    import uvicorn

    class KeepingSignals(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return KeepingSignals


def _warn_if_exposed(host: str, api_key: str | None) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        logger.warning(
            "listening on %s: reachable from other machines%s",
            host,
            "" if api_key else " and open to anyone (no --api-key / TPCORE_API_KEY set)",
        )


def serve(
    directory: str,
    num_gpus: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    name: str | None = None,
    limits: Limits | None = None,
    dtype: Any = None,
    compile: bool = False,
    restart: bool = True,
    exit_on_loss: bool = False,
) -> None:
    """Load ``directory`` split over ``num_gpus`` ranks (0: whole, in this process) and serve it until Ctrl-C;
    ``compile``: compile the ranks' decode step first (minutes; :func:`load_model`); ``restart``: a lost rank
    (dead, or hung past the call timeout) starts the ranks again from ``directory`` (503 meanwhile), else the
    server answers 503 from then on, ``/health`` included, for a supervisor to restart it; ``exit_on_loss``: the
    server answers the requests in flight 503, stops and raises :class:`RanksLost` (``tpcore serve`` exits 3).
    Under ``torchrun`` every rank calls this: the model is split over the world, rank 0 serves (docs/serving.md)."""
    _configure_logging()
    api_key = api_key or os.environ.get("TPCORE_API_KEY") or None
    if torchrun_world() is not None:
        _serve_under_torchrun(directory, num_gpus, host, port, api_key, name, limits, dtype, compile)
        return
    model, tokenizer = load_model(directory, num_gpus, dtype, compile)

    def reload() -> Any:
        return load_model(directory, num_gpus, dtype, compile)[0]

    service = None
    try:
        service = Service(model, tokenizer, name or Path(directory).name, limits, directory=directory,
                          reload=reload if restart and not exit_on_loss and num_gpus > 0 else None)  # fmt: skip
        Server(service, host, port, api_key, exit_on_loss=exit_on_loss).run()
    finally:
        for served in {id(each): each for each in (model, service and service.model)}.values():
            handle = getattr(served, "_tpcore_handle", None)
            if handle is not None:
                handle.pool.close()  # the ranks stop (not deparallelize(): it would gather a checkpoint's weights)
        logger.info("stopped")


def _serve_under_torchrun(directory: str, num_gpus: int, host: str, port: int, api_key: str | None, name: str | None,
                          limits: Limits | None, dtype: Any, compile: bool) -> None:  # fmt: skip
    """On every rank ``torchrun`` started: the model of ``directory`` split over the whole world (each rank reads
    its own slices), rank 0 serving HTTP, the others following its turns (:mod:`tpcore.serve.spmd`); all stop when
    rank 0 stops (Ctrl-C or SIGTERM to it). A lost rank ends the job (torchrun's own handling): rank 0 answers the
    requests in flight 503 and exits."""
    import signal

    import transformers

    from tpcore.engine import ParallelEngine
    from tpcore.ranks.distributed import destroy_process_group
    from tpcore.serve.spmd import TurnSync

    rank, world = torchrun_world() or (0, 1)
    if num_gpus != world:
        raise NotServable(f"under torchrun the model is split over all {world} ranks: --num-gpus {world}, not "
                          f"{num_gpus}")  # fmt: skip
    if compile:
        raise NotServable("--compile is not served under torchrun yet")
    auto_class(transformers.AutoConfig.from_pretrained(directory))  # a model the server refuses, before loading
    model = ParallelEngine(num_gpus=world, dtype=dtype).parallelize(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    turns = TurnSync()
    try:
        # every rank makes the same service: its start check's forwards are collective, and its engine (generation,
        # embeddings or transcriptions) is the one whose turns the other ranks follow
        service = Service(model, tokenizer, name or Path(directory).name, limits, directory=directory)
        service.scheduler.turns = turns
        if rank == 0:
            Server(service, host, port, api_key, exit_on_loss=True).run()
        else:
            # rank 0 alone decides when to stop: its stop plan ends this loop
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            service.scheduler.follow()
    finally:
        destroy_process_group()
        logger.info("rank %d stopped", rank)


def _configure_logging() -> None:
    serve_logger = logging.getLogger("tpcore.serve")
    if not serve_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        serve_logger.addHandler(handler)
        serve_logger.setLevel(logging.INFO)
        serve_logger.propagate = False
