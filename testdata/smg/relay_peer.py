"""What SMG's relay function, `smg_grpc_servicer.kv_relay.relay`, needs
around it to serve, shared by the scripts that run it (py_relay_server.py,
py_loads_servicer.py): their common flags, logging and rank sources, and an
asyncio gRPC server on loopback that says when it listens.
"""

import argparse
import asyncio
import json
import logging
import sys

import grpc
from smg_grpc_servicer import kv_relay


def parser() -> argparse.ArgumentParser:
    """The flags every relay peer takes: the engine's publisher endpoints,
    its DP size and the port to listen on (0: any)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default=None)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    return ap


def rank_sources(a: argparse.Namespace):
    """The relay's sources, one per DP rank, for the parsed flags a; the
    relay's logs go to stderr."""
    # The relay logs its subscriptions, replays and failures at
    # INFO/WARNING; tests read them on stderr when something goes wrong.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = argparse.Namespace(endpoint=a.endpoint, replay_endpoint=a.replay_endpoint)
    return kv_relay.rank_sources(config, range(a.dp_size))


async def serve(add_to_server, servicer, port: int) -> int:
    """Serves servicer (added by its add_…_to_server) on 127.0.0.1:port and
    prints {"ready": true, "port": N} once it listens; returns at
    termination."""
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(json.dumps({"ready": True, "port": port}), flush=True)
    await server.wait_for_termination()
    return 0


def run(main) -> None:
    """Runs the coroutine function main as the script, its result the exit
    status; an interrupt ends it quietly."""
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        pass
