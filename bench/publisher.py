"""Rate-controlled vLLM KV-event publisher for `kvrelay bench`.

It publishes one stream shape at a paced rate on one PUB per DP rank (the
engines' port+rank layout) and answers replay requests on one ROUTER per
rank, like vLLM's ZmqEventPublisher. Encoding every batch with msgspec costs
tens of microseconds in Python, which caps the rate well below what the
relays are asked to carry, so the payloads are encoded once, by msgspec in
vLLM's struct layout (testdata/peer/engine_peer.py's Encoder), and each
publish only patches fixed-width fields of a copy:

  * the batch timestamp (the first element, a msgpack float64) is set to
    time.time() at the moment of sending; both relays carry it through as
    KvEventBatch.timestamp, which is how the subscriber measures latency;
  * the 64 stored block hashes are (1<<63 | rank<<56 | seq<<8 | j): every
    batch is distinct and the subscriber can tell (rank, seq) from the first
    block's hash whatever the relay does to sequence numbers;
  * once seq >= --window, the batch also removes the 64 blocks it stored
    --window batches earlier on that rank, so the live-block set stays
    bounded as in an engine whose cache is full (store and evict per step).

Protocol (stdin/stdout, one JSON object per line). Ready line:
  {"op": "ready", "ranks": [{"rank", "pub", "replay"}], "payload_bytes": [a, b]}
Commands:
  {"op": "run", "rate": R, "seconds": S, "burst": B}  publish round-robin
      over the ranks at R batches/s in total for S seconds. Batch i is due at
      start + i/R; the publisher checks the clock after every B batches
      (default 1) and sleeps until the next one is due. With B = 1 every
      batch goes out at its own time, as an engine publishes one batch per
      scheduler step; B = 32 (what the bench used before 2026-12-03) sends
      32 batches back to back at the publisher's top speed, then sleeps ->
      {"op": "done", "first": [seq per rank], "last": [...], "sent": N,
       "elapsed": s, "achieved": batches/s}
  {"op": "quit"}
Between commands the ROUTERs are still served.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import struct
import sys
import threading
import time
from collections import deque

import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "peer"))
import engine_peer  # noqa: E402  (the repository's vLLM struct layouts and endpoint rules)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HIGH = 1 << 63
# Sentinel sequence numbers used only to locate the hash lists in the templates.
STORE_MARK = 0xABCDEF123456
REMOVE_MARK = 0x654321FEDCBA


def block_hash(rank: int, seq: int, j: int) -> int:
    return HIGH | (rank << 56) | (seq << 8) | j


def hash_prefix(rank: int, seq: int) -> bytes:
    """The 8 bytes msgpack writes before the low byte of every hash of (rank, seq):
    the uint64 marker and the hash's top seven bytes."""
    return b"\xcf" + ((HIGH | (rank << 56) | (seq << 8)) >> 8).to_bytes(7, "big")


LOW_BYTES = [b""] + [bytes([j]) for j in range(256)]


class Template:
    """One pre-encoded batch and the offsets of its patchable fields."""

    def __init__(self, enc: engine_peer.Encoder, rank: int, blocks: int, block_size: int, tokens: list, remove: bool):
        self.blocks = blocks
        events = [enc.event({
            "type": "stored",
            "hashes": [block_hash(rank, STORE_MARK, j) for j in range(blocks)],
            "tokens": tokens,
            "block_size": block_size,
        })]
        if remove:
            events.append(enc.event({"type": "removed", "hashes": [block_hash(rank, REMOVE_MARK, j) for j in range(blocks)]}))
        raw = enc.batch(events, rank, 1.0)
        if raw[0] != 0x93 or raw[1] != 0xCB:
            raise SystemExit(f"unexpected batch envelope {raw[:2].hex()}: want a 3-array starting with a float64")
        self.raw = raw
        self.store_at = self._locate(raw, rank, STORE_MARK)
        self.remove_at = self._locate(raw, rank, REMOVE_MARK) if remove else None
        self.join = LOW_BYTES[: blocks + 1]

    def _locate(self, raw: bytes, rank: int, mark: int) -> int:
        region = hash_prefix(rank, mark).join(LOW_BYTES[: self.blocks + 1])
        at = raw.find(region)
        if at < 0 or raw.find(region, at + 1) >= 0:
            raise SystemExit("cannot locate the block hash list in the template")
        return at

    def render(self, rank: int, seq: int, window: int) -> bytearray:
        buf = bytearray(self.raw)
        n = len(self.join) - 1
        buf[self.store_at: self.store_at + 9 * n] = hash_prefix(rank, seq).join(self.join)
        if self.remove_at is not None:
            buf[self.remove_at: self.remove_at + 9 * n] = hash_prefix(rank, seq - window).join(self.join)
        return buf


class Rank:
    def __init__(self, ctx: zmq.Context, rank: int, pub_ep: str, replay_ep: str, args, enc, tokens):
        self.rank = rank
        self.pub_ep = pub_ep
        self.replay_ep = replay_ep
        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.set_hwm(args.hwm)
        engine_peer.attach(self.pub, pub_ep)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        engine_peer.attach(self.router, replay_ep)
        self.seq = 0
        self.window = args.window
        self.ring: deque = deque(maxlen=args.buffer_steps)
        self.plain = Template(enc, rank, args.blocks, args.block_size, tokens, remove=False)
        self.evicting = Template(enc, rank, args.blocks, args.block_size, tokens, remove=True)
        self.topic = args.topic.encode()

    def publish(self, pack_ts) -> int:
        seq = self.seq
        self.seq += 1
        tpl = self.evicting if seq >= self.window else self.plain
        buf = tpl.render(self.rank, seq, self.window)
        pack_ts(buf, 2, time.time())
        payload = bytes(buf)
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.ring.append((seq, payload))
        return seq

    def serve_replay(self) -> None:
        # vLLM's framing: identity, empty, topic, seq, payload; then the end marker.
        while True:
            try:
                ident, _, start_b = self.router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.ring):
                if seq >= start:
                    self.router.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((ident, b"", b"", END_SEQ, b""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per store (at most 255)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=512, help="a batch removes what its rank stored this many batches earlier")
    ap.add_argument("--buffer-steps", type=int, default=10_000, help="replay ring per rank")
    ap.add_argument("--hwm", type=int, default=100_000)
    ap.add_argument("--topic", default="")
    args = ap.parse_args()
    if not 1 <= args.blocks <= 255:
        ap.error("--blocks must be 1..255")
    if args.dp_size < 1 or args.window < 1:
        ap.error("--dp-size and --window must be >= 1")

    enc = engine_peer.Encoder("vllm", "map")
    # Token ids of a realistic vocabulary; their values do not matter to a relay.
    tokens = [(i * 7919 + 17) % 151_936 for i in range(args.blocks * args.block_size)]
    ctx = zmq.Context()
    pub_base = f"tcp://127.0.0.1:{engine_peer.pick_base_ports('tcp://127.0.0.1:0', args.dp_size)}"
    rep_base = f"tcp://127.0.0.1:{engine_peer.pick_base_ports('tcp://127.0.0.1:0', args.dp_size)}"
    # Bind on the loopback address explicitly: the engines' bind rule wants a
    # wildcard, so bind through the "*" form and hand out the loopback form.
    ranks = []
    for r in range(args.dp_size):
        pub = engine_peer.offset_endpoint(pub_base, r).replace("127.0.0.1", "*")
        rep = engine_peer.offset_endpoint(rep_base, r).replace("127.0.0.1", "*")
        ranks.append(Rank(ctx, r, pub, rep, args, enc, tokens))

    out_lock = threading.Lock()

    def write(obj: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    commands: "queue.Queue[dict]" = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                commands.put(json.loads(line))
            except ValueError as e:
                write({"op": "error", "error": f"bad command: {e}"})
        commands.put({"op": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    write({
        "op": "ready",
        "ranks": [{"rank": r.rank, "pub": engine_peer.connect_form(r.pub_ep), "replay": engine_peer.connect_form(r.replay_ep)} for r in ranks],
        "payload_bytes": [len(ranks[0].plain.raw), len(ranks[0].evicting.raw)],
    })

    pack_ts = struct.Struct(">d").pack_into
    poller = zmq.Poller()
    for r in ranks:
        poller.register(r.router, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(20):
            for r in ranks:
                if r.router is sock:
                    r.serve_replay()
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            continue
        op = cmd.get("op")
        if op == "quit":
            break
        if op != "run":
            write({"op": "error", "error": f"unknown op {op!r}"})
            continue
        rate = float(cmd.get("rate", 0))
        seconds = float(cmd.get("seconds", 0))
        burst = int(cmd.get("burst", 1))
        if rate <= 0 or seconds <= 0 or burst < 1:
            write({"op": "error", "error": "rate and seconds must be positive, burst at least 1"})
            continue
        first = [r.seq for r in ranks]
        total = int(rate * seconds)
        n = len(ranks)
        start = time.monotonic()
        for i in range(total):
            ranks[i % n].publish(pack_ts)
            if i % burst == burst - 1:
                ahead = start + (i + 1) / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            if i % 256 == 255:
                for r in ranks:
                    r.serve_replay()
        elapsed = time.monotonic() - start
        write({
            "op": "done",
            "first": first,
            "last": [r.seq - 1 for r in ranks],
            "sent": total,
            "elapsed": elapsed,
            "achieved": total / elapsed if elapsed > 0 else 0.0,
        })
    for r in ranks:
        r.pub.close(linger=0)
        r.router.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
