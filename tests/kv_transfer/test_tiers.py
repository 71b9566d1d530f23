"""The KV tiers on their own: host memory, a disk directory and a real redis-server on a
loopback port. A corrupt, truncated, foreign or evicted entry is a miss, never an error."""

from __future__ import annotations

import time

from tandem.kv_transfer.entry import pack, unpack
from tandem.kv_transfer.tiers import DiskTier, HostTier, RedisTier

LAYOUT = "bfloat16:2x2x4x1x8"


def blocks(n: int, size: int = 100, salt: int = 0) -> list[tuple[bytes, bytes]]:
    return [(bytes([i, salt]) * 8, bytes([(i + salt) % 256]) * size) for i in range(n)]


def test_an_entry_round_trips_and_rejects_another_hash_layout_or_changed_bytes():
    (h, payload), (other, _) = blocks(2)
    entry = pack(h, LAYOUT, payload)
    assert bytes(unpack(h, LAYOUT, entry)) == payload
    assert unpack(other, LAYOUT, entry) is None
    assert unpack(h, "float32:2x2x4x1x8", entry) is None
    assert unpack(h, LAYOUT, entry[:-1]) is None  # truncated
    flipped = bytearray(entry)
    flipped[-1] ^= 1
    assert unpack(h, LAYOUT, bytes(flipped)) is None  # checksum
    assert unpack(h, LAYOUT, b"junk") is None and unpack(h, LAYOUT, None) is None


def test_host_tier_drops_the_least_recently_used_past_its_bytes():
    tier = HostTier(capacity_bytes=350)
    items = blocks(3)
    tier.put(items)
    assert tier.contains([h for h, _ in items]) == 3
    tier.get([items[0][0]])  # block 0 is now the most recent
    tier.put(blocks(4)[3:])
    assert tier.contains([items[0][0]]) == 1 and tier.contains([items[1][0]]) == 0
    assert tier.stats.evictions == 1 and len(tier) == 3
    assert tier.get([items[1][0]]) == [None] and tier.stats.misses == 1


def test_contains_counts_a_leading_run():
    tier = HostTier(1 << 20)
    items = blocks(4)
    tier.put([items[0], items[1], items[3]])
    assert tier.contains([h for h, _ in items]) == 2


def test_disk_tier_survives_a_restart_and_stays_under_its_size(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10_000, layout=LAYOUT)
    items = blocks(5, size=1000)
    tier.put(items)
    again = DiskTier(tmp_path, capacity_bytes=10_000, layout=LAYOUT)  # a restarted server
    assert again.contains([h for h, _ in items]) == 5
    assert [bytes(p) for p in again.get([h for h, _ in items])] == [p for _, p in items]
    small = DiskTier(tmp_path, capacity_bytes=3_500, layout=LAYOUT)  # shrunk at start
    assert len(small) == 3 and small.stats.evictions == 2
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) <= 3_500
    small.put(blocks(2, size=1000, salt=9))
    assert len(small) == 3 and sum(f.stat().st_size for f in tmp_path.iterdir()) <= 3_500


def test_a_corrupt_or_truncated_file_is_a_miss_and_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, layout=LAYOUT)
    items = blocks(2, size=500)
    tier.put(items)
    paths = sorted(tmp_path.glob("*.kv"), key=lambda p: p.name)
    data = bytearray(paths[0].read_bytes())
    data[-3] ^= 0xFF
    paths[0].write_bytes(bytes(data))
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    assert tier.get([h for h, _ in items]) == [None, None]
    assert tier.stats.misses == 2 and len(tier) == 0 and not list(tmp_path.glob("*.kv"))


def test_another_layout_in_the_same_directory_never_matches(tmp_path):
    DiskTier(tmp_path, 1 << 20, LAYOUT).put(blocks(2))
    other = DiskTier(tmp_path, 1 << 20, "float32:2x2x4x1x8")
    assert other.get([h for h, _ in blocks(2)]) == [None, None]


def test_redis_tier_reads_what_another_client_wrote(redis_server):
    a = RedisTier(redis_server.url, LAYOUT)
    b = RedisTier(redis_server.url, LAYOUT)  # another instance
    items = blocks(6, size=4096)
    a.put(items)
    hashes = [h for h, _ in items]
    assert b.contains(hashes) == 6
    assert [bytes(p) for p in b.get(hashes)] == [p for _, p in items]
    assert b.stats.hits == 6 and b.stats.bytes_loaded == 6 * 4096
    assert RedisTier(redis_server.url, "float32:1x2x4x1x8").get(hashes[:1]) == [None]


def test_a_killed_redis_is_a_miss_within_the_timeout_and_is_used_again_once_back(redis_server):
    tier = RedisTier(redis_server.url, LAYOUT, timeout_s=0.3, retry_s=0.5)
    items = blocks(3)
    tier.put(items)
    hashes = [h for h, _ in items]
    redis_server.kill()  # SIGKILL mid-service
    t0 = time.monotonic()
    assert tier.get(hashes) == [None] * 3
    assert tier.contains(hashes) == 0 and tier.stats.errors >= 1
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    assert tier.get(hashes) == [None] * 3  # down: no wait at all
    assert time.monotonic() - t0 < 0.05
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.6)
    tier.put(items)
    assert [bytes(p) for p in tier.get(hashes)] == [p for _, p in items]


def test_redis_entries_carry_their_metadata_in_one_key(redis_server):
    import redis

    tier = RedisTier(redis_server.url, LAYOUT)
    items = blocks(2)
    tier.put(items)
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys(b"tandem:kv:*"))
    assert len(keys) == 2
    client.set(keys[0], client.get(keys[0])[:-5])  # truncated by hand
    got = tier.get([h for h, _ in items])
    assert sum(p is None for p in got) == 1


def test_a_disk_tier_whose_directory_is_gone_drops_stores(tmp_path):
    where = tmp_path / "tier"
    tier = DiskTier(where, 1 << 20, LAYOUT)
    where.rmdir()
    where.write_text("not a directory any more")
    tier.put(blocks(1))
    assert tier.stats.errors == 1 and len(tier) == 0


def test_a_redis_killed_in_the_middle_of_a_read_is_a_miss_not_an_error(redis_server):
    import threading

    import redis

    tier = RedisTier(redis_server.url, LAYOUT, timeout_s=2.0, retry_s=0.2)
    items = blocks(8, size=1 << 16)
    tier.put(items)
    hashes = [h for h, _ in items]
    # Another client holds the single-threaded server busy: our MGET is sent and waits.
    sleeper = threading.Thread(
        target=lambda: _ignore_errors(
            lambda: redis.Redis.from_url(redis_server.url).execute_command("DEBUG", "SLEEP", "5")
        )
    )
    sleeper.start()
    time.sleep(0.2)
    result = {}
    reader = threading.Thread(target=lambda: result.update(got=tier.get(hashes)))
    t0 = time.monotonic()
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive()  # mid-read
    redis_server.kill()
    reader.join(5)
    sleeper.join(5)
    assert result["got"] == [None] * 8 and time.monotonic() - t0 < 2.5
    assert tier.stats.errors == 1 and tier.stats.misses == 8
    redis_server.start()
    time.sleep(0.3)
    tier.put(items)
    assert [bytes(p) for p in tier.get(hashes)] == [p for _, p in items]


def _ignore_errors(call) -> None:
    try:
        call()
    except Exception:
        pass
