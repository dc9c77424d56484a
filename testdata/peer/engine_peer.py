"""Fake LLM engine KV-event publisher for kvrelay's interop tests.

It behaves like the ZmqEventPublisher of vLLM, SGLang or TokenSpeed (see
/work/shared/research/engine-wire.md sections 1-4): one PUB per data-parallel
rank, an optional replay ROUTER per rank, a ring of the last --buffer-steps
(seq, payload) pairs, sequences from 0 per rank, and msgpack batches encoded
with msgspec in the engine's field order. Only pyzmq and msgspec are used.

Command line
------------
  --engine vllm|sglang|tokenspeed
  --dp-size N                 number of ranks (default 1)
  --endpoint EP               live PUB endpoint, offset by rank like the
                              engines' offset_endpoint_port (default tcp://*:0)
  --replay-endpoint EP        replay ROUTER endpoint (always bound); omit for
                              no ROUTER (the engines' default)
  --buffer-steps K            replay ring size in batches (default 10000)
  --topic T                   topic frame (default "")
  --hwm H                     PUB set_hwm (default 100000)
  --wire map|array            event layout. vllm: map (current) or array (the
                              12-slot legacy era); sglang: map (#37482) or
                              array (7-slot medium era); tokenspeed: array only
  --startup-clear batch|prepend|none
                              SGLang records AllBlocksCleared when its radix
                              cache is built. "batch" publishes it alone as
                              seq 0 right after binding (default for sglang),
                              "prepend" puts it in front of the first batch,
                              "none" (default for vllm and tokenspeed) skips it.

Bind rules are the engines': bind if the endpoint contains "*" or "::" or
starts with ipc:// or inproc://, else connect. A tcp port of 0 (with a bind
endpoint) is this peer's extension: it picks a free base port P such that
P..P+N-1 are all bindable, so ranks keep the engines' port+rank layout.

Protocol (stdin/stdout, one JSON object per line)
-------------------------------------------------
Once every socket is set up the peer prints
  {"op": "ready", "engine": ..., "ranks": [{"rank": 0, "pub": EP, "replay": EP|null,
   "pub_port": P, "replay_port": R|null}, ...]}
where EP are connect endpoints (tcp://127.0.0.1:P for tcp binds).

Each command is a JSON object with "op", an optional "id" (echoed back) and
usually "rank". Every command gets exactly one answer line: {"op": "ack",
"id": ..., ...} or {"op": "error", "id": ..., "error": "..."}. An ack is
written only after the rank's thread has handed everything to zmq.

  publish        {"rank", "events": [EVENT...], "ts"?}  -> {"seq", "live", "buffered"}
                 or the shorthand {"clear": bool, "stores": [[hashes, tokens,
                 parent], ...], "removes": [[hashes], ...]} (in that order).
  publish_many   {"rank", "count", "events"?, "rate"?} publishes count batches
                 (each its own seq; the same events, encoded once; default
                 one BlockStored with hash = seq) at most rate batches/s
                 (0 = as fast as possible) -> {"first_seq", "last_seq"}
  drop_next      {"rank", "count"?=1} the next count publishes consume a seq and
                 enter the ring but are not sent live (a PUB HWM drop)
  burn_next      {"rank", "count"?=1} the next count publishes consume a seq that
                 is neither sent nor buffered (a failed send)
  publish_raw    {"rank", "payload": hex} publishes these payload bytes as the
                 rank's next batch, exactly like publish (seq, ring, drop and
                 burn rules) but without encoding: for byte-exact vectors
  send_raw       {"rank", "frames": [hex, ...]} sends these frames on the PUB as
                 one message; consumes no seq (for malformed-message tests)
  restart        {"rank"} new PUB and ROUTER on the same ports, seq back to 0,
                 empty ring, SGLang startup clear again
  truncate_replay {"rank", "n"} replays send only their first n replies and no
                 end marker (SGLang HWM truncation); n < 0 restores normal replay
  pause_replay / resume_replay {"rank"} stop / start reading the ROUTER; queued
                 requests are answered after resume
  status         {} -> {"ranks": [{"rank", "next_seq", "ring_len", "ring_first",
                 "ring_last", "replays"}]}
  quit           {} -> {"op": "ack"} then exit

EVENT is {"type": "stored"|"removed"|"cleared", "hashes": [H...],
"tokens": [int...], "parent": H|null, "block_size": int, "medium": str,
"fields": {engine field name: value}} where H is an int (any sign, up to
64 bits) or {"bytes": hex} for a raw digest. "fields" overrides or adds
engine fields (lora_name, extra_keys, group_idx, cache_salt, token_ids for
bigram pairs, ...); unknown names are an error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = Union[int, bytes]


# --- vLLM structs (kv_events.py field order) ---------------------------------
class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class VllmStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class VllmRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VllmCleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


# The last array era (<= v0.23): every field written, 12 slots with the tag.
class VllmStoredArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class VllmRemovedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None


class VllmClearedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


# --- SGLang structs -----------------------------------------------------------
class SglangBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


class SglangStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None


class SglangRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = None


class SglangCleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class SglangStoredArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SglangRemovedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = None


class SglangClearedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


# --- TokenSpeed structs (5-slot BlockStored, no lora_id or medium) -----------
class TsBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


class TsStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int


class TsRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list


class TsCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


SCHEMAS = {
    ("vllm", "map"): (VllmBatch, VllmStored, VllmRemoved, VllmCleared),
    ("vllm", "array"): (VllmBatch, VllmStoredArray, VllmRemovedArray, VllmClearedArray),
    ("sglang", "map"): (SglangBatch, SglangStored, SglangRemoved, SglangCleared),
    ("sglang", "array"): (SglangBatch, SglangStoredArray, SglangRemovedArray, SglangClearedArray),
    ("tokenspeed", "array"): (TsBatch, TsStored, TsRemoved, TsCleared),
}


class CommandError(Exception):
    pass


def parse_hash(h: Any) -> Hash:
    if isinstance(h, bool):
        raise CommandError(f"bad hash {h!r}")
    if isinstance(h, int):
        if not -(1 << 63) <= h < (1 << 64):
            raise CommandError(f"hash {h} does not fit 64 bits")
        return h
    if isinstance(h, dict) and isinstance(h.get("bytes"), str):
        try:
            return bytes.fromhex(h["bytes"])
        except ValueError as e:
            raise CommandError(f"bad hash bytes: {e}") from None
    raise CommandError(f"bad hash {h!r}: want an int or {{\"bytes\": hex}}")


class Encoder:
    def __init__(self, engine: str, wire: str):
        key = (engine, wire)
        if key not in SCHEMAS:
            raise SystemExit(f"engine {engine} has no {wire} wire")
        self.engine = engine
        self.batch_cls, self.stored_cls, self.removed_cls, self.cleared_cls = SCHEMAS[key]
        self.enc = msgspec.msgpack.Encoder()

    def _build(self, cls, values: dict, fields: dict):
        names = set(cls.__struct_fields__)
        for k in fields:
            if k not in names:
                raise CommandError(f"{cls.__name__} has no field {k!r}")
        values = {k: v for k, v in values.items() if k in names}
        values.update(fields)
        try:
            return cls(**values)
        except TypeError as e:
            raise CommandError(f"{cls.__name__}: {e}") from None

    def event(self, ev: dict):
        if not isinstance(ev, dict):
            raise CommandError(f"event must be an object, got {ev!r}")
        typ = ev.get("type")
        fields = dict(ev.get("fields") or {})
        if "block_hashes" in fields:
            fields["block_hashes"] = [parse_hash(h) for h in fields["block_hashes"]]
        hashes = [parse_hash(h) for h in ev.get("hashes") or []]
        medium = ev.get("medium", "GPU")
        if typ == "stored":
            tokens = ev.get("tokens") or []
            parent = ev.get("parent")
            block_size = ev.get("block_size")
            if block_size is None:
                block_size = len(tokens) // len(hashes) if hashes else 0
            values = {
                "block_hashes": hashes,
                "parent_block_hash": None if parent is None else parse_hash(parent),
                "token_ids": tokens,
                "block_size": block_size,
                "lora_id": None,
                "medium": medium,
                "lora_name": None,
            }
            return self._build(self.stored_cls, values, fields)
        if typ == "removed":
            return self._build(self.removed_cls, {"block_hashes": hashes, "medium": medium}, fields)
        if typ == "cleared":
            return self._build(self.cleared_cls, {}, fields)
        raise CommandError(f"unknown event type {typ!r}")

    def batch(self, events: list, rank: int, ts: Optional[float] = None) -> bytes:
        b = self.batch_cls(time.time() if ts is None else float(ts), events, rank)
        return self.enc.encode(b)


def events_from_command(cmd: dict) -> list:
    if "events" in cmd:
        evs = cmd["events"]
        if not isinstance(evs, list):
            raise CommandError("events must be a list")
        return evs
    evs = []
    if cmd.get("clear"):
        evs.append({"type": "cleared"})
    for s in cmd.get("stores") or []:
        if not isinstance(s, list) or len(s) < 2:
            raise CommandError(f"store must be [hashes, tokens, parent?], got {s!r}")
        evs.append({"type": "stored", "hashes": s[0], "tokens": s[1], "parent": s[2] if len(s) > 2 else None})
    for r in cmd.get("removes") or []:
        if not isinstance(r, list) or len(r) < 1:
            raise CommandError(f"remove must be [hashes], got {r!r}")
        evs.append({"type": "removed", "hashes": r[0]})
    return evs


# --- endpoints -----------------------------------------------------------------
def is_bind(ep: str) -> bool:
    # The engines' rule, verbatim in meaning.
    return "*" in ep or "::" in ep or ep.startswith("ipc://") or ep.startswith("inproc://")


def offset_endpoint(ep: str, rank: int) -> str:
    # The engines' offset_endpoint_port.
    if not ep or rank == 0:
        return ep
    if "inproc" in ep:
        return f"{ep}_dp{rank}"
    if "tcp" in ep and ":" in ep:
        head, port = ep.rsplit(":", 1)
        return f"{head}:{int(port) + rank}"
    raise ValueError(f"cannot offset endpoint {ep} for rank {rank}")


def connect_form(ep: str) -> str:
    if ep.startswith("tcp://"):
        host, port = ep[len("tcp://"):].rsplit(":", 1)
        if host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
            host = "127.0.0.1"
        return f"tcp://{host}:{port}"
    return ep


def tcp_port(ep: str) -> Optional[int]:
    if ep.startswith("tcp://"):
        try:
            return int(ep.rsplit(":", 1)[1])
        except ValueError:
            return None
    return None


def attach(sock: zmq.Socket, ep: str, retry_s: float = 3.0) -> None:
    """Bind or connect per the engine rule. A rebind after close can race
    libzmq's asynchronous teardown of the old listener, hence the retry."""
    if not is_bind(ep):
        sock.connect(ep)
        return
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(ep)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def pick_base_ports(template: str, n: int, avoid: frozenset = frozenset()) -> int:
    """Find a base port P with P..P+n-1 free on the template's host and none
    of them in avoid. Plain sockets probe it: their close is synchronous,
    libzmq's is not. avoid holds the ports already picked for the other
    socket kind: once its probes are closed, the kernel may hand the same
    port to the next probe, and the PUB and the ROUTER would then collide
    (seen in CI: both ranks' ROUTERs "Address already in use")."""
    host = template[len("tcp://"):].rsplit(":", 1)[0]
    host = {"*": "0.0.0.0", "[::]": "::", "::": "::"}.get(host, host.strip("[]"))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200):
        probes = []
        try:
            first = socket.socket(family, socket.SOCK_STREAM)
            probes.append(first)
            first.bind((host, 0))
            base = first.getsockname()[1]
            if base + n > 65535 or any(base + r in avoid for r in range(n)):
                continue
            for r in range(1, n):
                s = socket.socket(family, socket.SOCK_STREAM)
                probes.append(s)
                s.bind((host, base + r))
            return base
        except OSError:
            continue
        finally:
            for s in probes:
                s.close()
    raise SystemExit("no free port range found")


# --- per-rank publisher --------------------------------------------------------
class Rank:
    """Everything one engine rank owns. Only its thread touches its sockets."""

    def __init__(self, peer: "Peer", rank: int, pub_ep: str, replay_ep: Optional[str]):
        self.peer = peer
        self.rank = rank
        self.pub_ep = pub_ep
        self.replay_ep = replay_ep
        self.cmd_push = peer.ctx.socket(zmq.PAIR)
        self.cmd_addr = f"inproc://engine-peer-cmd-{rank}"
        self.cmd_push.bind(self.cmd_addr)
        self.replies: "queue.Queue[dict]" = queue.Queue()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"publisher-{rank}", daemon=True)
        self.pub: Optional[zmq.Socket] = None
        self.router: Optional[zmq.Socket] = None
        self.truncate = -1
        self.paused = False
        self.replays = 0
        self.setup_error: Optional[str] = None

    # Runs on the rank thread.
    def open_sockets(self) -> None:
        ctx = self.peer.ctx
        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.set_hwm(self.peer.args.hwm)
        attach(self.pub, self.pub_ep)
        if self.replay_ep:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.linger = 0
            attach(self.router, self.replay_ep)  # the engines always bind it
        self.seq = itertools.count()
        self.next_seq = 0
        self.ring: deque = deque(maxlen=self.peer.args.buffer_steps)
        self.drop = 0
        self.burn = 0
        self.pending_clear = False
        mode = self.peer.startup_clear
        if mode == "batch":
            self.publish([self.peer.encoder.event({"type": "cleared"})], None)
        elif mode == "prepend":
            self.pending_clear = True

    def close_sockets(self) -> None:
        for s in (self.pub, self.router):
            if s is not None:
                s.close(linger=0)
        self.pub = self.router = None

    def publish(self, events: list, ts: Optional[float]) -> dict:
        if self.pending_clear:
            events = [self.peer.encoder.event({"type": "cleared"})] + events
            self.pending_clear = False
        payload = self.peer.encoder.batch(events, self.rank, ts)
        return self.emit(payload)

    def emit(self, payload: bytes) -> dict:
        seq = next(self.seq)
        self.next_seq = seq + 1
        if self.burn > 0:
            self.burn -= 1
            return {"seq": seq, "live": False, "buffered": False}
        live = True
        if self.drop > 0:
            self.drop -= 1
            live = False
        else:
            self.pub.send_multipart((self.peer.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.ring.append((seq, payload))
        return {"seq": seq, "live": live, "buffered": True}

    def service_replay(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                print(f"rank {self.rank}: invalid replay request ({len(frames)} frames)", file=sys.stderr)
                continue
            self.replays += 1
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            vllm = self.peer.args.engine == "vllm"
            sent = 0
            for seq, payload in list(self.ring):
                if seq < start:
                    continue
                if 0 <= self.truncate <= sent:
                    break
                seq_b = seq.to_bytes(8, "big")
                if vllm:
                    self.router.send_multipart((ident, b"", self.peer.topic, seq_b, payload))
                else:
                    self.router.send_multipart((ident, b"", seq_b, payload))
                sent += 1
            if self.truncate >= 0:
                continue  # truncated: the end marker is lost too
            if vllm:
                self.router.send_multipart((ident, b"", b"", END_SEQ, b""))
            else:
                self.router.send_multipart((ident, b"", END_SEQ, b""))

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        enc = self.peer.encoder
        if op == "publish":
            events = [enc.event(e) for e in events_from_command(cmd)]
            return self.publish(events, cmd.get("ts"))
        if op == "publish_many":
            count = int(cmd.get("count", 0))
            rate = float(cmd.get("rate") or 0)
            if count <= 0:
                raise CommandError("count must be positive")
            template = cmd.get("events")
            fixed = None
            if template is not None:
                fixed = enc.batch([enc.event(e) for e in template], self.rank, cmd.get("ts"))
            first = None
            last = None
            start = time.monotonic()
            for i in range(count):
                if fixed is None:
                    h = self.next_seq + 1
                    payload = enc.batch([enc.event({"type": "stored", "hashes": [h], "tokens": [1, 2, 3, 4]})], self.rank)
                else:
                    payload = fixed
                r = self.emit(payload)
                if first is None:
                    first = r["seq"]
                last = r["seq"]
                if rate > 0 and i % 64 == 63:
                    ahead = start + (i + 1) / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                if self.router is not None and not self.paused and i % 256 == 255:
                    self.service_replay()
            return {"first_seq": first, "last_seq": last}
        if op == "drop_next":
            self.drop += int(cmd.get("count", 1))
            return {"drop_pending": self.drop}
        if op == "burn_next":
            self.burn += int(cmd.get("count", 1))
            return {"burn_pending": self.burn}
        if op == "publish_raw":
            try:
                payload = bytes.fromhex(cmd.get("payload") or "")
            except (TypeError, ValueError) as e:
                raise CommandError(f"bad payload hex: {e}") from None
            return self.emit(payload)
        if op == "send_raw":
            frames = cmd.get("frames")
            if not isinstance(frames, list) or not frames:
                raise CommandError("frames must be a non-empty list of hex strings")
            try:
                raw = [bytes.fromhex(f) for f in frames]
            except (TypeError, ValueError) as e:
                raise CommandError(f"bad frame hex: {e}") from None
            self.pub.send_multipart(raw)
            return {"frames": len(raw)}
        if op == "restart":
            self.close_sockets()
            self.open_sockets()
            return {"next_seq": self.next_seq}
        if op == "truncate_replay":
            self.truncate = int(cmd.get("n", -1))
            return {"truncate": self.truncate}
        if op == "pause_replay":
            self.paused = True
            return {}
        if op == "resume_replay":
            self.paused = False
            return {}
        if op == "status":
            ring = list(self.ring)
            return {
                "rank": self.rank,
                "next_seq": self.next_seq,
                "ring_len": len(ring),
                "ring_first": ring[0][0] if ring else None,
                "ring_last": ring[-1][0] if ring else None,
                "replays": self.replays,
                "paused": self.paused,
                "truncate": self.truncate,
            }
        raise CommandError(f"unknown op {op!r}")

    def run(self) -> None:
        cmd = self.peer.ctx.socket(zmq.PAIR)
        cmd.connect(self.cmd_addr)
        try:
            self.open_sockets()
        except Exception as e:  # reported on the ready line
            self.setup_error = f"rank {self.rank}: {e}"
            self.ready.set()
            cmd.close()
            return
        self.ready.set()
        try:
            while True:
                poller = zmq.Poller()
                poller.register(cmd, zmq.POLLIN)
                if self.router is not None and not self.paused:
                    poller.register(self.router, zmq.POLLIN)
                ready = dict(poller.poll())
                if self.router is not None and ready.get(self.router):
                    self.service_replay()
                if ready.get(cmd):
                    msg = json.loads(cmd.recv())
                    if msg.get("op") == "quit":
                        self.replies.put({})
                        return
                    try:
                        self.replies.put(self.handle(msg))
                    except CommandError as e:
                        self.replies.put({"error": str(e)})
                    except Exception as e:  # keep the peer alive; report it
                        self.replies.put({"error": f"{type(e).__name__}: {e}"})
        finally:
            self.close_sockets()
            cmd.close()

    # Runs on the main thread.
    def call(self, cmd: dict, timeout: float = 300.0) -> dict:
        self.cmd_push.send(json.dumps(cmd).encode())
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            return {"error": f"rank {self.rank} did not answer in {timeout}s"}


class Peer:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.topic = args.topic.encode()
        wire = args.wire or ("array" if args.engine == "tokenspeed" else "map")
        self.encoder = Encoder(args.engine, wire)
        self.startup_clear = args.startup_clear or ("batch" if args.engine == "sglang" else "none")
        self.out_lock = threading.Lock()
        pub_base = self.resolve(args.endpoint, args.dp_size)
        pub_ports = frozenset(p + r for p in [tcp_port(pub_base)] if p for r in range(args.dp_size))
        replay_base = self.resolve(args.replay_endpoint, args.dp_size, pub_ports) if args.replay_endpoint else None
        self.ranks = [
            Rank(self, r, offset_endpoint(pub_base, r), offset_endpoint(replay_base, r) if replay_base else None)
            for r in range(args.dp_size)
        ]

    def resolve(self, ep: str, n: int, avoid: frozenset = frozenset()) -> str:
        if ep.startswith("tcp://") and is_bind(ep) and tcp_port(ep) == 0:
            head = ep.rsplit(":", 1)[0]
            return f"{head}:{pick_base_ports(ep, n, avoid)}"
        return ep

    def write(self, obj: dict) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def start(self) -> bool:
        for r in self.ranks:
            r.thread.start()
        for r in self.ranks:
            r.ready.wait()
        errors = [r.setup_error for r in self.ranks if r.setup_error]
        if errors:
            self.write({"op": "error", "error": "; ".join(errors)})
            return False
        self.write({
            "op": "ready",
            "engine": self.args.engine,
            "ranks": [{
                "rank": r.rank,
                "pub": connect_form(r.pub_ep),
                "replay": connect_form(r.replay_ep) if r.replay_ep else None,
                "pub_port": tcp_port(r.pub_ep),
                "replay_port": tcp_port(r.replay_ep) if r.replay_ep else None,
            } for r in self.ranks],
        })
        return True

    def serve(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                cmd = json.loads(line)
                if not isinstance(cmd, dict) or not isinstance(cmd.get("op"), str):
                    raise CommandError("a command is a JSON object with an op")
            except (ValueError, CommandError) as e:
                self.write({"op": "error", "id": None, "error": f"bad command: {e}"})
                continue
            cid = cmd.get("id")
            op = cmd["op"]
            if op == "quit":
                break
            if op == "status":
                ranks = [r.call({"op": "status"}) for r in self.ranks]
                self.write({"op": "ack", "id": cid, "ranks": ranks})
                continue
            rank = cmd.get("rank", 0)
            if not isinstance(rank, int) or not 0 <= rank < len(self.ranks):
                self.write({"op": "error", "id": cid, "error": f"no rank {rank!r}"})
                continue
            res = self.ranks[rank].call(cmd)
            if "error" in res:
                self.write({"op": "error", "id": cid, "error": res["error"]})
            else:
                self.write({"op": "ack", "id": cid, **res})
        self.shutdown()
        self.write({"op": "ack", "id": None, "bye": True})

    def shutdown(self) -> None:
        for r in self.ranks:
            if r.thread.is_alive():
                r.call({"op": "quit"}, timeout=5)
                r.thread.join(timeout=5)
            r.cmd_push.close(linger=0)
        self.ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["vllm", "sglang", "tokenspeed"], required=True)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--endpoint", default="tcp://*:0")
    p.add_argument("--replay-endpoint", default=None)
    p.add_argument("--buffer-steps", type=int, default=10_000)
    p.add_argument("--topic", default="")
    p.add_argument("--hwm", type=int, default=100_000)
    p.add_argument("--wire", choices=["map", "array"], default=None)
    p.add_argument("--startup-clear", choices=["batch", "prepend", "none"], default=None)
    args = p.parse_args()
    if args.dp_size < 1:
        p.error("--dp-size must be >= 1")
    if args.buffer_steps < 1:
        p.error("--buffer-steps must be >= 1")
    peer = Peer(args)
    if not peer.start():
        peer.shutdown()
        sys.exit(1)
    peer.serve()


if __name__ == "__main__":
    main()
