"""The shared store's key layout and the Lua scripts that change it (`redis_store`).

Every key starts with `gymproxy:`. A rollout's own keys hold its id between braces; an id is
`[A-Za-z0-9._:@+=-]{1,200}`, never a brace, so the id, and with it the key, is read back
unambiguously: no id can name another rollout's key or a shared one (which has no brace). The
braces also put a rollout's keys in one hash slot.

    gymproxy:{<id>}:meta     hash: state, created, updated, frozen_at, refused
    gymproxy:{<id>}:calls    hash: call_id -> the call's record (JSON, `record.encode_call`); its end replaces its start
    gymproxy:{<id>}:order    list: call ids in the order their first record was written (seq)
    gymproxy:{<id>}:failed   set: call ids whose outcome is in_flight, error or cut
    gymproxy:open, gymproxy:frozen   sorted sets of ids (score 0: listed by id)
    gymproxy:updated                 sorted set of ids by their last write (eviction by age)

Each script runs atomically in Redis: a rollout frozen by one process takes no record from any
other. Without a `#!lua` line a script is refused for a full Redis (maxmemory, OOM) at its first
write, so a refused script has written nothing.
"""

from __future__ import annotations

from typing import Final, NamedTuple

OPEN: Final = "gymproxy:open"
FROZEN: Final = "gymproxy:frozen"
UPDATED: Final = "gymproxy:updated"
PROBE: Final = "gymproxy:probe"  # written to learn whether a full Redis takes writes again


class Keys(NamedTuple):
    """One rollout's keys."""

    meta: str
    calls: str
    order: str
    failed: str

    @classmethod
    def of(cls, rollout_id: str) -> Keys:
        base = f"gymproxy:{{{rollout_id}}}:"
        return cls(base + "meta", base + "calls", base + "order", base + "failed")


# KEYS: meta, calls, order, failed, OPEN, UPDATED
# ARGV: id, now, ttl_ms, created, then (call_id, "1" when its outcome counts as failed, record) each
# Returns 1 when written, 0 when the rollout is frozen (nothing written).
WRITE: Final = """
if redis.call('HGET', KEYS[1], 'state') == 'frozen' then return 0 end
for i = 5, #ARGV, 3 do
  if redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2]) == 1 then
    redis.call('RPUSH', KEYS[3], ARGV[i])
  end
  if ARGV[i + 1] == '1' then
    redis.call('SADD', KEYS[4], ARGV[i])
  else
    redis.call('SREM', KEYS[4], ARGV[i])
  end
end
if redis.call('HSETNX', KEYS[1], 'created', ARGV[4]) == 1 then
  redis.call('HSET', KEYS[1], 'state', 'open')
  redis.call('ZADD', KEYS[5], 0, ARGV[1])
end
redis.call('HSET', KEYS[1], 'updated', ARGV[2])
redis.call('ZADD', KEYS[6], ARGV[2], ARGV[1])
for k = 1, 4 do redis.call('PEXPIRE', KEYS[k], ARGV[3]) end
return 1
"""

# KEYS: meta, OPEN, FROZEN; ARGV: id, now. Returns 0 for an unknown rollout; a frozen one stays as it was.
FREEZE: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'frozen' then
  redis.call('HSET', KEYS[1], 'state', 'frozen', 'frozen_at', ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[1])
end
return 1
"""

# KEYS: meta. A call refused for a frozen rollout is counted in it.
REFUSE: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'refused', 1) end
return 0
"""

# KEYS: meta, calls, order, failed, OPEN, FROZEN, UPDATED; ARGV: id, cutoff ("" to delete whatever
# its age). Returns {existed, calls}, or {-1, 0} when it was written since `cutoff`.
DROP: Final = """
if ARGV[2] ~= '' then
  local updated = redis.call('ZSCORE', KEYS[7], ARGV[1])
  if updated and tonumber(updated) >= tonumber(ARGV[2]) then return {-1, 0} end
end
local existed = redis.call('EXISTS', KEYS[1])
local calls = redis.call('HLEN', KEYS[2])
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
return {existed, calls}
"""

# KEYS: calls, order; ARGV: start, stop (places in the order). The records of those calls.
READ: Final = """
local ids = redis.call('LRANGE', KEYS[2], ARGV[1], ARGV[2])
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[1], unpack(ids))
"""
