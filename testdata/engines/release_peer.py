"""An engine release's own KV-event publisher, driven for kvrelay's interop tests.

testdata/peer/engine_peer.py imitates the engines; this script runs the
engine's real code instead: the kv_events module that fetch.py copied out of
the release's wheel, loaded by file path with a few small stubs for what it
imports from the rest of the engine (a config dataclass, a logger, network
helpers). Its EventPublisherFactory, ZmqEventPublisher, KVEventBatch and
event structs then decide the framing, the replay ROUTER, the msgspec
encoding, the rank port offsets and the bind rules.

It speaks testdata/peer/engine_peer.py's JSON-lines protocol (same ready
line and commands, see that script's docstring) so testkit/enginepeer drives
both, with these differences:

  --release DIR   the release's folder from fetch.py (.venv/engines/NAME)
  --os-ports      keep a tcp://*:0 endpoint as it is (vLLM >= 0.33 binds
                  each rank to an OS-assigned port, #55844); without it this
                  script picks a free base port so ranks use base + rank and
                  a restart binds the same ports again
  publish_raw and send_raw are refused: the engine encodes its own batches.
  ring_payload {"rank", "seq"} -> {"payload": hex}: the bytes the engine
                encoded for that batch, read from its replay ring
  namespaced_hash {"hash", "extra_key"?, "cache_salt"?} -> {"hash"}: SGLang's
                own kv_event_namespace_seed + namespaced_block_hash
  Faults are injected around the engine's sockets, not in its code:
    drop_next   the engine's PUB send succeeds without sending (what
                libzmq does at the PUB high-water mark): the batch keeps its
                seq and enters the engine's ring
    burn_next   the PUB send raises, so the engine's own error path burns
                the seq (neither sent nor buffered)
    truncate_replay / pause_replay act on the engine's ROUTER the same way.
  The ready line also carries "reported": the endpoints the engine itself
  reports for each rank (vLLM's get_publisher_config, SGLang's
  describe_local_source), null where the release reports none.
"""

import argparse
import dataclasses
import inspect
import importlib.util
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import types

import zmq

ENGINE_FILES = {
    "vllm": "vllm/distributed/kv_events.py",
    "sglang": "sglang/srt/disaggregation/kv_events.py",
    "tokenspeed": "tokenspeed/runtime/pd/kv_events.py",
}


# --- stubs for what the kv_events modules import from their engine ---------

def _split_zmq_path(path):
    scheme, rest = path.split("://", 1)
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def _tcp_uri(ip, port):
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _is_ipv6(address):
    try:
        socket.inet_pton(socket.AF_INET6, address)
        return True
    except (OSError, ValueError):
        return False


class NetworkAddress:
    """sglang.srt.utils.network.NetworkAddress, as far as kv_events uses it."""

    def __init__(self, host, port):
        self.host, self.port = host, port

    @property
    def is_ipv6(self):
        return _is_ipv6(self.host)

    @classmethod
    def parse(cls, text):
        if text.startswith("["):
            host, _, port = text[1:].partition("]:")
        else:
            host, _, port = text.rpartition(":")
            if ":" in host:
                raise ValueError(f"unbracketed IPv6 address {text!r}")
        return cls(host, int(port))

    def to_tcp(self):
        return _tcp_uri(self.host, self.port)


class BaseModel:
    """pydantic.BaseModel, as far as the engines' KVEventsConfig uses it:
    fields with defaults, model_validate_json and model_dump."""

    @classmethod
    def _fields(cls):
        names = {}
        for klass in reversed(cls.__mro__):
            for name in getattr(klass, "__annotations__", {}):
                names[name] = getattr(cls, name, None)
        return names

    def __init__(self, **values):
        for name, default in self._fields().items():
            setattr(self, name, values.pop(name, default))
        if values:
            raise TypeError(f"unknown config fields {sorted(values)}")

    @classmethod
    def model_validate_json(cls, text):
        return cls(**json.loads(text))

    def model_dump(self):
        return {name: getattr(self, name) for name in self._fields()}


@dataclasses.dataclass
class VLLMKVEventsConfig:
    """vllm.config.KVEventsConfig of releases before 0.11."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


STUBS = {
    "vllm.config.utils": {"config": dataclasses.dataclass},
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.utils.network_utils": {
        # The node IP a tcp://*:0 publisher binds; loopback on a test host.
        "get_ip": lambda: os.environ.get("VLLM_HOST_IP", "127.0.0.1"),
        "get_tcp_uri": _tcp_uri,
        "is_valid_ipv6_address": _is_ipv6,
        "split_zmq_path": _split_zmq_path,
    },
    "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    "sglang.srt.runtime_context": {"get_parallel": lambda: None},
    "sglang.srt.utils.network": {"NetworkAddress": NetworkAddress},
}


def install_stubs(release_dir):
    for name, attrs in STUBS.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    try:
        import pydantic  # noqa: F401  a real pydantic wins where installed
    except ImportError:
        module = types.ModuleType("pydantic")
        module.BaseModel = BaseModel
        sys.modules["pydantic"] = module
    # Parent packages, empty, so "from vllm.x import y" resolves.
    for name in list(sys.modules):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                package = types.ModuleType(parent)
                package.__path__ = []
                sys.modules[parent] = package


def load_file(release_dir, path):
    name = path[: -len(".py")].replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, os.path.join(release_dir, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_engine(engine, release_dir):
    install_stubs(release_dir)
    config = None
    if engine == "vllm":
        if os.path.exists(os.path.join(release_dir, "vllm/config/kv_events.py")):
            # The release's own KVEventsConfig dataclass (0.11+); its
            # @config decorator is the stub above.
            config = load_file(release_dir, "vllm/config/kv_events.py")
        else:
            # Older releases keep it in vllm/config.py, which imports torch:
            # a dataclass with the same fields and defaults stands in.
            config = types.ModuleType("vllm.config")
            config.__path__ = []
            config.KVEventsConfig = VLLMKVEventsConfig
            sys.modules["vllm.config"] = config
    return load_file(release_dir, ENGINE_FILES[engine]), config


# --- fault injection around the engine's sockets ---------------------------

class RankFaults:
    def __init__(self):
        self.lock = threading.Lock()
        self.drop = 0
        self.burn = 0
        self.truncate = -1
        self.replies_left = -1
        self.paused = False
        self.replays = 0
        self.sent = queue.Queue()  # (seq, live, buffered) per send attempt


class PubProxy:
    """The engine's PUB socket with drops and burns injected."""

    def __init__(self, sock, faults):
        self._sock, self._faults = sock, faults

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def send_multipart(self, frames, *args, **kwargs):
        seq = int.from_bytes(frames[-2], "big")
        f = self._faults
        with f.lock:
            burn = f.burn > 0
            drop = not burn and f.drop > 0
            if burn:
                f.burn -= 1
            elif drop:
                f.drop -= 1
        if burn:
            f.sent.put((seq, False, False))
            raise zmq.Again("injected: a failed send burns this sequence")
        if not drop:
            self._sock.send_multipart(frames, *args, **kwargs)
        f.sent.put((seq, not drop, True))


class ReplayProxy:
    """The engine's ROUTER with paused reads and HWM truncation injected."""

    def __init__(self, sock, faults):
        self._sock, self._faults = sock, faults

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def poll(self, *args, **kwargs):
        if self._faults.paused:
            return 0
        return self._sock.poll(*args, **kwargs)

    def recv_multipart(self, *args, **kwargs):
        frames = self._sock.recv_multipart(*args, **kwargs)
        with self._faults.lock:
            self._faults.replays += 1
            self._faults.replies_left = self._faults.truncate
        return frames

    def send_multipart(self, frames, *args, **kwargs):
        with self._faults.lock:
            if self._faults.replies_left == 0:
                return  # dropped at the HWM, silently, as libzmq's ROUTER does
            if self._faults.replies_left > 0:
                self._faults.replies_left -= 1
        self._sock.send_multipart(frames, *args, **kwargs)


# --- the engine ------------------------------------------------------------

def pick_base_port(n):
    """A base port P with P..P+n-1 free on the wildcard address."""
    for _ in range(200):
        probes = []
        try:
            first = socket.socket()
            probes.append(first)
            first.bind(("0.0.0.0", 0))
            base = first.getsockname()[1]
            if base + n > 65535:
                continue
            for r in range(1, n):
                s = socket.socket()
                probes.append(s)
                s.bind(("0.0.0.0", base + r))
            return base
        except OSError:
            continue
        finally:
            for s in probes:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_port_free(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
        try:
            probe.bind(("0.0.0.0", port))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {port} still in use {timeout} s after the publisher closed")
            time.sleep(0.01)
        finally:
            probe.close()


def connect_endpoint(endpoint):
    scheme, host, port = _split_zmq_path(endpoint)
    if host in ("*", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return _tcp_uri(host, port) if scheme == "tcp" else endpoint


class Engine:
    def __init__(self, args):
        self.args = args
        self.name = args.engine
        self.mod, self.config_mod = load_engine(args.engine, args.release)
        self.endpoint = self._base(args.endpoint)
        self.replay_endpoint = self._base(args.replay_endpoint) if args.replay_endpoint else None
        self.startup_clear = args.startup_clear or ("batch" if self.name == "sglang" else "none")
        self.faults = [RankFaults() for _ in range(args.dp_size)]
        self.next_seq = [0] * args.dp_size
        self.pubs = [None] * args.dp_size
        for rank in range(args.dp_size):
            self.start_rank(rank)

    def _base(self, endpoint):
        if endpoint.endswith(":0") and not self.args.os_ports:
            return endpoint[:-1] + str(pick_base_port(self.args.dp_size))
        return endpoint

    def _create(self, rank):
        """The rank's publisher, made by the engine's own factory from the
        config an operator would give it."""
        cfg = {"publisher": "zmq", "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
               "buffer_steps": self.args.buffer_steps, "hwm": self.args.hwm, "topic": self.args.topic}
        create = self.mod.EventPublisherFactory.create
        if self.name == "vllm":
            config = self.config_mod.KVEventsConfig(enable_kv_cache_events=True, **cfg)
        elif self.name == "tokenspeed":
            config = json.dumps({"enable_kv_cache_events": True, **cfg})
        else:
            config = json.dumps(cfg)
        params = inspect.signature(create).parameters
        rank_param = next((p for p in ("data_parallel_rank", "attn_dp_rank") if p in params), None)
        if rank_param is not None:
            pub = create(config, **{rank_param: rank})
        elif rank == 0:
            # Releases before DP support (vLLM 0.9, SGLang 0.4.6) have one
            # publisher and no rank in their batches.
            pub = create(config)
        else:
            raise ValueError("this release's publisher has no DP rank: run it with one rank")
        if not isinstance(pub, self.mod.ZmqEventPublisher):
            raise RuntimeError(f"the factory made a {type(pub).__name__}, not a ZmqEventPublisher")
        faults = self.faults[rank]
        pub._pub = PubProxy(pub._pub, faults)
        if pub._replay is not None:
            pub._replay = ReplayProxy(pub._replay, faults)
        return pub

    def start_rank(self, rank):
        self.faults[rank] = RankFaults()
        self.pubs[rank] = self._create(rank)
        self.next_seq[rank] = 0
        if self.startup_clear == "batch":
            # SGLang's scheduler records AllBlocksCleared when it builds its
            # radix cache, so each incarnation's first batch is a clear.
            self.publish(rank, [{"type": "cleared"}])

    def endpoints(self, rank):
        pub = self.pubs[rank]
        live = connect_endpoint(pub._endpoint)
        replay = connect_endpoint(pub._replay_endpoint) if pub._replay_endpoint else None
        reported = None
        if hasattr(pub, "get_publisher_config"):
            cfg = pub.get_publisher_config()
            reported = {"pub": cfg.endpoint, "replay": cfg.replay_endpoint}
        elif hasattr(pub, "describe_local_source"):
            src = pub.describe_local_source(0) or {}
            reported = {"pub": src.get("endpoint"), "replay": src.get("replay_endpoint")}
        return {"rank": rank, "pub": live, "replay": replay, "reported": reported}

    def hash(self, h):
        if isinstance(h, dict):
            return bytes.fromhex(h["bytes"])
        return h

    def event(self, ev):
        kind = ev["type"]
        if kind == "cleared":
            return self.mod.AllBlocksCleared()
        cls = {"stored": self.mod.BlockStored, "removed": self.mod.BlockRemoved}[kind]
        fields = cls.__struct_fields__
        required = fields[: len(fields) - len(cls.__struct_defaults__)]
        kw = {name: None for name in required}
        kw["block_hashes"] = [self.hash(h) for h in ev.get("hashes", [])]
        if ev.get("medium") is not None or "medium" in fields:
            kw["medium"] = ev.get("medium") or "GPU"
        if kind == "stored":
            tokens = ev.get("tokens", [])
            kw["token_ids"] = tokens
            parent = ev.get("parent")
            kw["parent_block_hash"] = None if parent is None else self.hash(parent)
            n = len(kw["block_hashes"])
            kw["block_size"] = ev.get("block_size") or (len(tokens) // n if n else 0)
        for name, value in (ev.get("fields") or {}).items():
            kw[name] = value
        unknown = sorted(set(kw) - set(fields))
        if unknown:
            raise ValueError(f"{cls.__name__} of this release has no fields {unknown}")
        return cls(**kw)

    def publish(self, rank, events, ts=None):
        batch = self.mod.KVEventBatch(ts=time.time() if ts is None else ts,
                                      events=[self.event(e) for e in events])
        seq = self.next_seq[rank]
        self.next_seq[rank] += 1
        pub = self.pubs[rank]
        pub.publish(batch)
        got, live, buffered = self.faults[rank].sent.get(timeout=30)
        if got != seq:
            raise RuntimeError(f"rank {rank}: the engine sent seq {got}, expected {seq}")
        if buffered:
            # The engine appends to its ring right after the send returns.
            deadline = time.monotonic() + 30
            while not (pub._buffer and pub._buffer[-1][0] >= seq):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}: seq {seq} never reached the ring")
                time.sleep(0.001)
        return {"seq": seq, "live": live, "buffered": buffered}

    def restart(self, rank):
        """A new incarnation on the same ports: the engine's own shutdown,
        then a fresh publisher from the factory (seq from 0, empty ring)."""
        old = self.pubs[rank]
        old.shutdown()
        # libzmq closes sockets in its reaper thread, after close() returns;
        # a new engine process would find the ports released, so wait for that.
        for endpoint in (old._endpoint, old._replay_endpoint):
            if endpoint and endpoint.startswith("tcp://"):
                wait_port_free(int(_split_zmq_path(endpoint)[2]))
        self.start_rank(rank)

    def status(self):
        out = []
        for r, pub in enumerate(self.pubs):
            ring = list(pub._buffer)
            f = self.faults[r]
            out.append({"rank": r, "next_seq": self.next_seq[r], "ring_len": len(ring),
                        "ring_first": ring[0][0] if ring else None, "ring_last": ring[-1][0] if ring else None,
                        "replays": f.replays, "paused": f.paused, "truncate": f.truncate})
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True)
    ap.add_argument("--engine", required=True, choices=sorted(ENGINE_FILES))
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--endpoint", default="tcp://*:0")
    ap.add_argument("--replay-endpoint")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--topic", default="")
    ap.add_argument("--hwm", type=int, default=100_000)
    ap.add_argument("--wire", default="", help="accepted for compatibility; the release decides")
    ap.add_argument("--startup-clear", choices=["batch", "none"])
    ap.add_argument("--os-ports", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)

    def write(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        engine = Engine(args)
    except Exception as e:  # the ready line names the failure
        write({"op": "error", "error": f"{type(e).__name__}: {e}"})
        raise
    write({"op": "ready", "engine": args.engine, "release": os.path.basename(args.release.rstrip("/")),
           "ranks": [engine.endpoints(r) for r in range(args.dp_size)]})

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op, cid = cmd.get("op"), cmd.get("id")
        try:
            rank = cmd.get("rank", 0)
            if op == "quit":
                break
            elif op == "publish":
                out = engine.publish(rank, cmd.get("events", []), cmd.get("ts"))
            elif op == "publish_many":
                first = last = None
                events = cmd.get("events")
                for _ in range(cmd["count"]):
                    seq = engine.next_seq[rank]
                    evs = events or [{"type": "stored", "hashes": [seq + 1], "tokens": [seq % 1000]}]
                    last = engine.publish(rank, evs)["seq"]
                    first = last if first is None else first
                    if cmd.get("rate"):
                        time.sleep(1 / cmd["rate"])
                out = {"first_seq": first, "last_seq": last}
            elif op in ("drop_next", "burn_next"):
                f = engine.faults[rank]
                with f.lock:
                    if op == "drop_next":
                        f.drop += cmd.get("count", 1)
                    else:
                        f.burn += cmd.get("count", 1)
                out = {}
            elif op == "truncate_replay":
                engine.faults[rank].truncate = cmd["n"]
                out = {}
            elif op in ("pause_replay", "resume_replay"):
                engine.faults[rank].paused = op == "pause_replay"
                out = {}
            elif op == "restart":
                engine.restart(rank)
                out = engine.endpoints(rank)
            elif op == "status":
                out = {"ranks": engine.status()}
            elif op == "ring_payload":
                # The bytes the engine encoded for a batch, from its own ring.
                found = [buf for seq, buf in list(engine.pubs[rank]._buffer) if seq == cmd["seq"]]
                if not found:
                    raise ValueError(f"seq {cmd['seq']} is not in rank {rank}'s ring")
                out = {"payload": found[0].hex()}
            elif op == "namespaced_hash":
                # SGLang's own namespacing of a block hash by extra_key and
                # cache_salt (the "dynamo" format, 0.5.23).
                seed = engine.mod.kv_event_namespace_seed(extra_key=cmd.get("extra_key"),
                                                          cache_salt=cmd.get("cache_salt"))
                out = {"hash": engine.mod.namespaced_block_hash(cmd["hash"], namespace_seed=seed)}
            elif op == "endpoints":
                out = {"ranks": [engine.endpoints(r) for r in range(args.dp_size)]}
            else:
                raise ValueError(f"{op} is not supported by an engine's own publisher")
            write({"op": "ack", "id": cid, **out})
        except Exception as e:
            write({"op": "error", "id": cid, "error": f"{type(e).__name__}: {e}"})
    for pub in engine.pubs:
        pub.shutdown()


if __name__ == "__main__":
    main()
