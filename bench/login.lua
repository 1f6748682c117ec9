-- wrk script: the case-study POST /login in a loop; every request registers
-- a new device (anyone may call it). bench/device-rate.sh MODE=login and
-- bench/prune.sh.
wrk.method = "POST"
wrk.body = '{"username":"flood"}'
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  io.write(string.format("RESULT requests=%d errors_status=%d\n", summary.requests, summary.errors.status))
end
