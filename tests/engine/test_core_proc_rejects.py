"""A request that reaches the engine-core process with fields that fail validation (a front
end's bug: the server checks first) is rejected by its id; the core keeps running."""

from __future__ import annotations

import msgspec

from tandem.core.sampling_params import SamplingParams
from tandem.engine.messages import ABORT, ADD, SHUTDOWN, CoreMessage, CoreOutputs, EngineCoreRequest
from tests.engine.parked_core import launch


def test_an_invalid_request_is_rejected_by_id_and_the_core_lives_on(tmp_path):
    ctx, inbox, outbox, proc = launch(tmp_path)
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    try:
        assert outbox.poll(30_000), "the loop never stepped"
        decoder.decode(outbox.recv())
        request = EngineCoreRequest("bad-1", [1, 2], SamplingParams(max_tokens=5), 0.0)
        fields = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
        fields[2]["min_tokens"] = 9  # past max_tokens: SamplingParams refuses it on decode
        inbox.send_multipart([ADD, msgspec.msgpack.encode(fields)])
        assert outbox.poll(10_000)
        out = decoder.decode(outbox.recv())
        assert isinstance(out, CoreOutputs)
        assert [rid for rid, _ in out.rejected] == ["bad-1"]
        assert "min_tokens" in out.rejected[0][1]
        inbox.send_multipart([ABORT, msgspec.msgpack.encode(["nobody"])])
        assert outbox.poll(5_000), "the core stopped answering"
        assert proc.poll() is None
        inbox.send_multipart([SHUTDOWN])
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
