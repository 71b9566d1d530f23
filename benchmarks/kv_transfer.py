"""KV transfer throughput on loopback TCP: tandem's connector (per-layer wire format) against
raw pyzmq sending the same bytes as the same multipart messages and touching nothing, one
run. Two figures for the connector: the transport alone (each layer handed over as a view of
the received frame, as raw pyzmq's receiver gets it), and with each layer also copied into a
preallocated destination as it lands (the import the decode engine does into its pool).

    python benchmarks/kv_transfer.py [--tokens 2048] [--repeats 5]

The KV is the default model's shape (SmolLM2-135M: 30 layers, 3 KV heads of 64) in bfloat16.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import zmq

from tandem.kv_transfer.connector import KVReceiver, KVSender


def tandem_seconds(kv: torch.Tensor, cache: torch.Tensor | None) -> float:
    """With `cache`, each layer lands in it as it arrives, as the decode engine writes its
    pool; without, it is only handed over."""
    receiver, sender = KVReceiver("tcp://127.0.0.1:0"), KVSender()

    def on_layer(rid, layer, start, k, v):
        if cache is not None:
            cache[layer, 0].copy_(k)
            cache[layer, 1].copy_(v)

    start = time.perf_counter()
    t = threading.Thread(target=sender.send, args=(receiver.address, "r", 0, kv))
    t.start()
    while not receiver.poll(on_layer, 1000):
        pass
    elapsed = time.perf_counter() - start
    t.join()
    assert cache is None or torch.equal(cache, kv)
    sender.close()
    receiver.close()
    return elapsed


def raw_seconds(kv: torch.Tensor) -> float:
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("tcp://127.0.0.1:0")
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    layers = [
        (kv[i, 0].view(torch.uint8).numpy(), kv[i, 1].view(torch.uint8).numpy())
        for i in range(kv.shape[0])
    ]

    def send():
        for k, v in layers:
            push.send_multipart([b"h", k, v], copy=False)

    start = time.perf_counter()
    t = threading.Thread(target=send)
    t.start()
    for _ in layers:
        pull.recv_multipart(copy=False)
    elapsed = time.perf_counter() - start
    t.join()
    push.close()
    pull.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    kv = torch.randn(30, 2, args.tokens, 3, 64).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    cache = torch.zeros_like(kv)  # a warm destination, as an engine's KV pool is
    runs = []  # interleaved, so a noisy moment does not fall on one contender only
    for _ in range(args.repeats):
        runs.append((raw_seconds(kv), tandem_seconds(kv, None), tandem_seconds(kv, cache)))
    raw, transport, imported = (min(r[i] for r in runs) for i in range(3))
    print(f"KV of {args.tokens} tokens, {nbytes / 1e6:.1f} MB, best of {args.repeats}:")
    print(f"  raw pyzmq:                   {nbytes / raw / 1e9:.2f} GB/s ({raw * 1e3:.1f} ms)")
    print(
        f"  tandem connector:            {nbytes / transport / 1e9:.2f} GB/s "
        f"({transport * 1e3:.1f} ms) = {raw / transport:.0%} of raw (target >= 80%)"
    )
    print(
        f"  connector + import per layer: {nbytes / imported / 1e9:.2f} GB/s "
        f"({imported * 1e3:.1f} ms) = {raw / imported:.0%} of raw"
    )


if __name__ == "__main__":
    main()
