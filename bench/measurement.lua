-- wrk script: case-study POST /measurement from many devices, each request a
-- new reading (unique device time), so every 200 is a stored row.
-- Device ids come from the file named by env DEVICES (one UUID a line).
local threads = {}
local counter = 0

function setup(thread)
  counter = counter + 1
  thread:set("tid", counter)
  table.insert(threads, thread)
end

function init(args)
  devices = {}
  for line in io.lines(os.getenv("DEVICES")) do
    devices[#devices + 1] = line
  end
  n = 0
  base = tonumber(os.getenv("BASE_EPOCH"))
  wrk.method = "POST"
end

function request()
  n = n + 1
  local dev = devices[(n + tid * 7919) % #devices + 1]
  -- a unique microsecond per (thread, request): no duplicates
  local us = n * 64 + tid
  local secs = base + math.floor(us / 1000000)
  local frac = us % 1000000
  local t = os.date("!%Y-%m-%dT%H:%M:%S", secs) .. string.format(".%06dZ", frac)
  local body = string.format('{"time":"%s","charge_now":%d,"charge_full":100,"charge_rate":-2.5,"ambient_temp":21.5,"water_temp":%.1f,"water_level":%d}',
    t, n % 100, 20 + (n % 80), n % 100)
  return wrk.format("POST", "/measurement", {["servant-auth-cookie"] = dev, ["Content-Type"] = "application/json"}, body)
end

function done(summary, latency, requests)
  local codes = 0
  io.write(string.format("RESULT requests=%d duration_s=%.2f rps=%.1f p50_ms=%.2f p99_ms=%.2f max_ms=%.2f errors_status=%d errors_connect=%d errors_timeout=%d\n",
    summary.requests, summary.duration / 1e6, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000,
    summary.errors.status, summary.errors.connect, summary.errors.timeout))
end
