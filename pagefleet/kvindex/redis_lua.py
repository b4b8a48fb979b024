"""Server-side Lua scripts of the Redis index (see redis_index.py for the layout).

Every script takes one key, KEYS[1] = the namespace prefix ``pf:{ns=<ns>}:``. All keys the
scripts touch start with it, so they share the prefix's hash tag and therefore one Redis
Cluster slot, and the client routes the script by KEYS[1].

Block hashes travel as 8-byte big-endian strings (Lua numbers are doubles and would lose
precision). A pod is a 2-byte big-endian id inside block values.
"""

from __future__ import annotations

# Shared helpers, prepended to every script.
_COMMON = r"""
local P = KEYS[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Bucket divisor and the field's offset inside the 8-byte hash. The bucket key ends with
-- the hash's first two bytes, low (16 - bits) bits zeroed; the field keeps every byte the
-- bucket does not fully cover, so (bucket, field) identifies the hash exactly.
local function layout(bits)
  local fstart = 2
  if bits == 16 then fstart = 3 end
  return 2 ^ (16 - bits), fstart - 1
end

local function id_at(v, j)
  local a, b = string.byte(v, j, j + 1)
  return a * 256 + b
end

local function enc_id(n)
  return string.char(math.floor(n / 256), n % 256)
end

-- Add pod `idn` (2-byte string id2) to a block's value, keeping ids sorted so equal pod
-- sets give equal strings. Returns 1 when the pod was not there yet.
local function add_pod(key, field, id2, idn, likely_new)
  local v
  if likely_new then
    -- Most stored blocks are new to the index: one call settles those.
    if redis.call('HSETNX', key, field, id2) == 1 then return 1 end
    v = redis.call('HGET', key, field)
  else
    -- A resync mostly re-asserts blocks the pod already holds: read first.
    v = redis.call('HGET', key, field)
    if not v then
      redis.call('HSET', key, field, id2)
      return 1
    end
  end
  for j = 1, #v, 2 do
    local c = id_at(v, j)
    if c == idn then return 0 end
    if c > idn then
      redis.call('HSET', key, field, string.sub(v, 1, j - 1) .. id2 .. string.sub(v, j))
      return 1
    end
  end
  redis.call('HSET', key, field, v .. id2)
  return 1
end

-- Remove pod `idn` from a block's value; drops the field when no pod is left.
local function remove_pod(key, field, idn)
  local v = redis.call('HGET', key, field)
  if not v then return 0 end
  for j = 1, #v, 2 do
    local c = id_at(v, j)
    if c == idn then
      if #v == 2 then
        redis.call('HDEL', key, field)
      else
        redis.call('HSET', key, field, string.sub(v, 1, j - 1) .. string.sub(v, j + 2))
      end
      return 1
    end
    if c > idn then return 0 end
  end
  return 0
end

local function holds(key, field, idn)
  local v = redis.call('HGET', key, field)
  if not v then return false end
  for j = 1, #v, 2 do
    local c = id_at(v, j)
    if c == idn then return true end
    if c > idn then return false end
  end
  return false
end

local function bits_or(default)
  redis.call('SET', P .. 'cfg', default, 'NX')
  return tonumber(redis.call('GET', P .. 'cfg'))
end

-- Lowest id that is neither registered nor still being swept.
local function new_id(name)
  local i = 0
  while redis.call('HEXISTS', P .. 'pid', i) == 1 or redis.call('SISMEMBER', P .. 'dead', i) == 1 do
    i = i + 1
  end
  if i > 65535 then
    error('pagefleet index: 65536 pod ids in use in ' .. P ..
      '; call gc() so dead pods release theirs')
  end
  redis.call('HSET', P .. 'pod', name, i)
  redis.call('HSET', P .. 'pid', i, name)
  return i
end

-- An interrupted resync leaves part of the pod's log in r2 (and the wanted set in rs):
-- fold it back into r so every hash the pod may hold stays reachable for clearing.
local function merge_resync(id)
  local r2 = P .. 'r2:' .. id
  for _, chunk in ipairs(redis.call('LRANGE', r2, 0, -1)) do
    redis.call('RPUSH', P .. 'r:' .. id, chunk)
  end
  redis.call('DEL', r2, P .. 'rs:' .. id)
end

local function touch(id, until_ms)
  local old = tonumber(redis.call('HGET', P .. 'exp', id) or '0')
  if until_ms > old then redis.call('HSET', P .. 'exp', id, until_ms) end
end
"""

# ARGV: default bucket bits, pod name, then one argument per event: a kind byte followed by
# the packed hashes. Kinds: 'S' stored, 'R' removed, 'C' all cleared; a resync is 'B'
# (begin), 'A' (add a chunk of the new set), 'F' (finish: drop what is not in the new set).
# Returns 1 when a resync's finish must be called again, plus 2 when an 'S' registered a pod
# the index did not know (its earlier blocks, if it had any, are not here).
# A 'C' on a pod that holds entries gives the pod a fresh id: the old id's entries stop
# counting at once (no live heartbeat under it) and gc() sweeps them later, so clearing is
# O(1) inside this script however many blocks the pod held.
APPLY = (
    _COMMON
    + r"""
local name = ARGV[2]
local bits = bits_or(ARGV[1])
local div, foff = layout(bits)
local id = redis.call('HGET', P .. 'pod', name)
local idn, id2
if id then idn = tonumber(id); id2 = enc_id(idn) end
local now = now_ms()
local log = {}
local nlog, delta = 0, 0
local more = 0  -- 1 when a resync's finish ran out of budget and must be called again
local anew = 0  -- 2 when a stored block registered a pod the index did not know

local function flush()
  if idn == nil then return end
  if nlog > 0 then
    local step = 128
    for s = 1, nlog, step do
      redis.call('RPUSH', P .. 'r:' .. idn, table.concat(log, '', s, math.min(s + step - 1, nlog)))
    end
    redis.call('HINCRBY', P .. 'st', 'l' .. idn, nlog)
  end
  if delta ~= 0 then redis.call('HINCRBY', P .. 'st', 'n' .. idn, delta) end
  log = {}
  nlog, delta = 0, 0
end

for a = 3, #ARGV do
  local ev = ARGV[a]
  local kind = string.sub(ev, 1, 1)
  if kind == 'S' or kind == 'A' then
    if idn == nil then
      idn = new_id(name)
      id2 = enc_id(idn)
      if kind == 'S' then anew = 2 end
    end
    if kind == 'A' then
      redis.call('RPUSH', P .. 'r2:' .. idn, string.sub(ev, 2))
      local members = {}
      for p = 2, #ev, 8 do members[#members + 1] = string.sub(ev, p, p + 7) end
      for s = 1, #members, 1024 do
        redis.call('SADD', P .. 'rs:' .. idn, unpack(members, s, math.min(s + 1023, #members)))
      end
    end
    for p = 2, #ev, 8 do
      local b1, b2 = string.byte(ev, p, p + 1)
      local key = P .. 'b' .. string.char(b1, b2 - b2 % div)
      if add_pod(key, string.sub(ev, p + foff, p + 7), id2, idn, kind == 'S') == 1 then
        nlog = nlog + 1
        log[nlog] = string.sub(ev, p, p + 7)
        delta = delta + 1
      end
    end
  elseif kind == 'R' then
    if idn ~= nil then
      for p = 2, #ev, 8 do
        local b1, b2 = string.byte(ev, p, p + 1)
        local key = P .. 'b' .. string.char(b1, b2 - b2 % div)
        delta = delta - remove_pod(key, string.sub(ev, p + foff, p + 7), idn)
      end
    end
  elseif kind == 'C' then
    if idn ~= nil then
      flush()
      -- Always re-id, not only when the log exists: under allkeys-lru eviction the log
      -- may be gone while block entries remain, and those must stop counting too.
      do
        local old = idn
        merge_resync(old)
        redis.call('SADD', P .. 'dead', old)
        redis.call('HDEL', P .. 'pid', old)
        redis.call('HDEL', P .. 'st', 'n' .. old, 'l' .. old)
        idn = new_id(name)
        id2 = enc_id(idn)
        if redis.call('EXISTS', P .. 'hb:' .. old) == 1 then
          redis.call('RENAME', P .. 'hb:' .. old, P .. 'hb:' .. idn)
        end
        touch(idn, tonumber(redis.call('HGET', P .. 'exp', old) or '0'))
        redis.call('HDEL', P .. 'exp', old)
      end
    end
  elseif kind == 'B' then
    -- Resync begins: 'A' chunks add the new set (logged in r2, members in the set rs);
    -- 'F' calls then pop the old log r in slices and drop every hash not in rs. Blocks
    -- held before and after never disappear from lookups.
    if idn == nil then
      idn = new_id(name)
      id2 = enc_id(idn)
    end
    merge_resync(idn)
  elseif kind == 'F' then
    if idn ~= nil then
      local r, rs = P .. 'r:' .. idn, P .. 'rs:' .. idn
      local budget = 1024  -- hashes per call: a few ms, then the client calls again
      while true do
        local chunk = redis.call('LPOP', r)
        if not chunk then
          flush()
          local n = redis.call('SCARD', rs)
          if n > 0 then
            redis.call('RENAME', P .. 'r2:' .. idn, r)
          else
            redis.call('DEL', P .. 'r2:' .. idn)
          end
          redis.call('DEL', rs)
          redis.call('HSET', P .. 'st', 'n' .. idn, n, 'l' .. idn, n)
          break
        end
        for p = 1, #chunk, 8 do
          local h = string.sub(chunk, p, p + 7)
          if redis.call('SISMEMBER', rs, h) == 0 then
            local b1, b2 = string.byte(h, 1, 2)
            delta = delta - remove_pod(P .. 'b' .. string.char(b1, b2 - b2 % div),
                                       string.sub(h, 1 + foff), idn)
          end
        end
        budget = budget - #chunk / 8
        if budget <= 0 then
          more = 1
          break
        end
      end
    end
  else
    return redis.error_reply('pagefleet index: unknown event kind ' .. kind)
  end
end
flush()
if idn == nil then return 0 end
touch(idn, now)

-- Removals leave stale hashes in the pod's log; rewrite it once they dominate, so the log
-- stays O(blocks held) (amortized O(1) per event).
local st = redis.call('HMGET', P .. 'st', 'n' .. idn, 'l' .. idn)
local held, logged = tonumber(st[1] or '0'), tonumber(st[2] or '0')
-- Not while a resync is in flight: its finish is popping this log in slices.
if logged > 2 * held + 1024 and redis.call('EXISTS', P .. 'r2:' .. idn) == 0 then
  local chunks = redis.call('LRANGE', P .. 'r:' .. idn, 0, -1)
  local seen, keep, nkeep = {}, {}, 0
  for _, chunk in ipairs(chunks) do
    for p = 1, #chunk, 8 do
      local h = string.sub(chunk, p, p + 7)
      if not seen[h] then
        seen[h] = true
        local b1, b2 = string.byte(h, 1, 2)
        local key = P .. 'b' .. string.char(b1, b2 - b2 % div)
        if holds(key, string.sub(h, 1 + foff), idn) then
          nkeep = nkeep + 1
          keep[nkeep] = h
        end
      end
    end
  end
  redis.call('DEL', P .. 'r:' .. idn)
  for s = 1, nkeep, 128 do
    redis.call('RPUSH', P .. 'r:' .. idn, table.concat(keep, '', s, math.min(s + 127, nkeep)))
  end
  redis.call('HSET', P .. 'st', 'l' .. idn, nkeep, 'n' .. idn, nkeep)
end
return more + anew
"""
)

# ARGV: packed hashes of one segment of the prompt's blocks, in chain order; the number of
# blocks before this segment; the packed ids of pods still matching after the previous
# segment ('' for the first segment: candidates are then the live holders of block 0).
# Returns {ids still matching at the segment's end, packed ('' if none), then pod name,
# matched leading blocks (counted from the prompt's start), ...} for pods with >= 1 block.
#
# Bisection, not a block-by-block walk. A pod's blocks are prefix-closed (the contract in
# kvindex/events.py), so along the prompt the holder set only shrinks. Equal values at two
# positions then mean equal values at every position between them, and only the intervals
# where the set changes need probing: a full hit costs 2 HGETs, a hit ending at block k
# about 2 + log2(n), instead of k. Each position is probed at most once, so the worst case
# is the walk. On a set with a hole (a lost event) a pod may count past the hole, never
# short of its true prefix.
LOOKUP = (
    _COMMON
    + r"""
local bits = tonumber(redis.call('GET', P .. 'cfg') or '0')
if bits == 0 then return {''} end
local div, foff = layout(bits)
local hs = ARGV[1]
local nb = #hs / 8
local offset = tonumber(ARGV[2])
local carry_in = nil
if ARGV[3] ~= '' then
  carry_in = {}
  for j = 1, #ARGV[3], 2 do carry_in[id_at(ARGV[3], j)] = true end
end
-- Locals, not global lookups, in the hot path.
local call, sbyte, schar, ssub, floor = redis.call, string.byte, string.char, string.sub, math.floor
local PB = P .. 'b'
local vals = {}  -- position (0-based) -> raw holder ids ('' when no pod holds the block)
local function probe(i)
  local p = i * 8 + 1
  local b1, b2 = sbyte(hs, p, p + 1)
  local v = call('HGET', PB .. schar(b1, b2 - b2 % div), ssub(hs, p + foff, p + 7)) or ''
  vals[i] = v
  return v
end
local len = {}  -- pod id -> leading blocks of this segment it holds
local function set_len(v, n)
  for j = 1, #v, 2 do
    local id = id_at(v, j)
    if (len[id] or 0) < n then len[id] = n end
  end
end
if probe(0) ~= '' then
  local last = nb - 1
  if last > 0 then probe(last) end
  -- Intervals [lo, hi] with both ends probed, as a flat stack of pairs.
  local stack, top = {0, last}, 2
  while top > 0 do
    local lo, hi = stack[top - 1], stack[top]
    top = top - 2
    local a = vals[lo]
    if a ~= vals[hi] then
      if hi == lo + 1 then
        set_len(a, hi)  -- holders of block lo lacking block hi: hi leading blocks
      else
        local mid = floor((lo + hi) / 2)
        probe(mid)
        stack[top + 1], stack[top + 2], stack[top + 3], stack[top + 4] = lo, mid, mid, hi
        top = top + 4
      end
    end
  end
  set_len(vals[last], nb)
end
-- Liveness and names of all candidates in one MGET and one HMGET, not two calls per pod.
-- Only holders of the segment's first block match (a hole at block 0 must not count).
local ids, first = {}, {}
local v0 = vals[0]
for j = 1, #v0, 2 do first[id_at(v0, j)] = true end
for id in pairs(len) do
  if first[id] and (carry_in == nil or carry_in[id]) then ids[#ids + 1] = id end
end
if carry_in then
  -- Pods that matched every earlier block but not this segment's first one.
  for id in pairs(carry_in) do
    if not first[id] then
      len[id] = 0
      ids[#ids + 1] = id
    end
  end
end
local out, carry = {''}, {}
-- Slices keep unpack() far below Lua's C-stack limit however many pods hold block 0.
for s = 1, #ids, 512 do
  local e = math.min(s + 511, #ids)
  local slice = {unpack(ids, s, e)}
  local live = nil
  if carry_in == nil then
    local keys = {}
    for k, id in ipairs(slice) do keys[k] = P .. 'hb:' .. id end
    live = call('MGET', unpack(keys))
  end
  local names = call('HMGET', P .. 'pid', unpack(slice))
  for k, id in ipairs(slice) do
    local n = len[id]
    if live == nil or live[k] then
      if n == nb then carry[#carry + 1] = enc_id(id) end
      if offset + n > 0 and names[k] then
        out[#out + 1] = names[k]
        out[#out + 1] = offset + n
      end
    end
  end
end
out[1] = table.concat(carry)
return out
"""
)

# ARGV: default bucket bits, pod name, load json, ttl in ms. Returns 2 when the pod was
# registered anew (the index did not know it: its first heartbeat, or its entries were lost
# to a flush, a restart, an eviction or gc), else 1.
HEARTBEAT = (
    _COMMON
    + r"""
bits_or(ARGV[1])
local name = ARGV[2]
local ttl = tonumber(ARGV[4])
local id = redis.call('HGET', P .. 'pod', name)
local known = 1
if not id then
  id = new_id(name)
  known = 2
end
redis.call('SET', P .. 'hb:' .. id, ARGV[3], 'PX', ttl)
touch(id, now_ms() + ttl)
return known
"""
)

# Returns a flat array: pod name, load json, ... for pods with a live heartbeat.
PODS = (
    _COMMON
    + r"""
local all = redis.call('HGETALL', P .. 'pid')
local out = {}
for k = 1, #all, 2 do
  local load = redis.call('GET', P .. 'hb:' .. all[k])
  if load then
    out[#out + 1] = all[k + 1]
    out[#out + 1] = load
  end
end
return out
"""
)

# ARGV: grace in ms, budget (hash removals this call). Moves pods whose heartbeat expired
# more than `grace` ago to the graveyard, then sweeps graveyard ids' entries within the
# budget so one call never blocks Redis for long. Returns {pods retired, ids left to sweep}.
GC = (
    _COMMON
    + r"""
local bits = tonumber(redis.call('GET', P .. 'cfg') or '0')
local now = now_ms()
local grace = tonumber(ARGV[1])
local budget = tonumber(ARGV[2])
local retired = 0
local all = redis.call('HGETALL', P .. 'pid')
for k = 1, #all, 2 do
  local id, name = all[k], all[k + 1]
  if redis.call('EXISTS', P .. 'hb:' .. id) == 0 then
    local e = tonumber(redis.call('HGET', P .. 'exp', id) or '0')
    if e + grace <= now then
      redis.call('HDEL', P .. 'pid', id)
      redis.call('HDEL', P .. 'pod', name)
      redis.call('HDEL', P .. 'exp', id)
      redis.call('HDEL', P .. 'st', 'n' .. id, 'l' .. id)
      merge_resync(id)
      redis.call('SADD', P .. 'dead', id)
      retired = retired + 1
    end
  end
end
if bits > 0 then
  local div, foff = layout(bits)
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'dead')) do
    if budget <= 0 then break end
    local idn = tonumber(id)
    while budget > 0 do
      local chunk = redis.call('LPOP', P .. 'r:' .. id)
      if not chunk then break end
      for p = 1, #chunk, 8 do
        local b1, b2 = string.byte(chunk, p, p + 1)
        local key = P .. 'b' .. string.char(b1, b2 - b2 % div)
        remove_pod(key, string.sub(chunk, p + foff, p + 7), idn)
      end
      budget = budget - #chunk / 8
    end
    if redis.call('EXISTS', P .. 'r:' .. id) == 0 then
      redis.call('SREM', P .. 'dead', id)
    end
  end
else
  redis.call('DEL', P .. 'dead')
end
return {retired, redis.call('SCARD', P .. 'dead')}
"""
)
