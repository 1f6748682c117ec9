"""A kettle fleet for Locust: the same kettles `kettle swarm` simulates.

Each Locust user is one kettle: a small physical model (battery charge,
reservoir level, water and ambient temperature; the same equations and
constants as sim/model.go) that obeys the commands it polls. Charging raises
the charge, fill raises the level, flush lowers it, heating drains the
battery, and now and then somebody draws a cup. Every KETTLE_INTERVAL
(constant_pacing, each kettle at its own random phase) a kettle posts its
reading, then polls its command.

    locust -f contrib/locust/locustfile.py --host http://127.0.0.1:8080 \
        --headless -u 2000 -r 200 -t 5m

Environment:
    KETTLE_API             v0 (default): the case-study firmware: POST /login,
                           then servant-auth-cookie on POST /measurement and
                           GET /command.
                           v1: bearer device tokens, POST /v1/measurements and
                           GET /v1/command (with ETag / If-None-Match).
    KETTLE_SECRET          v1: derive device tokens offline from kettle serve's
                           secret (kettle-data/secret), like `kettle token`.
    KETTLE_OPERATOR_TOKEN  v1 without a secret: provision devices in batches
                           through POST /v1/devices (kettle-data/operator-token).
    KETTLE_INTERVAL        time between a kettle's readings: 30, 30s, 500ms, 2m
                           (default 30 s).
    KETTLE_SEED            seed of the kettles' physics and phases (default 1).

Failures are counted per request: a 503 (ingest queue full) is a failure, and
the kettle keeps the reading and retries it later like real firmware, waiting
at least the server's Retry-After (exponential backoff with jitter, capped at
the interval), never hammering. A 400 is a reading the server can never
accept: counted and dropped. A 401 on v0 makes the kettle log in again.

Be aware of what this measures. Locust's pacing is a CLOSED model: a user
sends its next request only after the previous one came back, and
constant_pacing can only shorten the wait, not overlap requests. If the
server slows down, the load it receives drops with it, and Locust's response
times start when a request is actually sent, not when it was due, so they hide
the queueing (coordinated omission). This is the trap the case study fell
into. `kettle swarm` is an OPEN model (requests are due on each kettle's own
schedule whether or not the previous one returned, latency is measured from
the intended send time, its own lag is reported) and it audits that every
acknowledged reading was stored. Use it to judge a server; use this file if
your tooling is Locust. Locust also runs on a single core per process and
costs several times the CPU per request of `kettle swarm`
(bench/locust-vs-swarm.sh compares them): watch for its "CPU usage above 90%" warning, past
which it offers less load than asked and its response times include its own
scheduling delay (run more worker processes with --master/--worker).

The environment names are those of kettle swarm's flags (--api, --interval,
--secret, --operator-token, --seed); only the default API differs (v0 here,
the case study's firmware).
"""

import base64
import hashlib
import hmac
import itertools
import json
import math
import os
import random
import time
import uuid
from datetime import datetime, timezone

import gevent
from gevent.lock import Semaphore
from locust import FastHttpUser, constant_pacing, task


def _env_seconds(name, default):
    """Seconds from the environment: "30", "30s", "500ms" or "2m" (the
    same KETTLE_INTERVAL that kettle swarm reads as a Go duration)."""
    v = os.environ.get(name, "").strip()
    if v == "":
        return default
    scale = 1.0
    for suffix, mult in (("ms", 1e-3), ("s", 1.0), ("m", 60.0)):
        if v.endswith(suffix):
            v, scale = v[: -len(suffix)], mult
            break
    try:
        f = float(v) * scale
    except ValueError:
        f = -1.0
    if not 0 < f < math.inf:
        raise SystemExit(f"locustfile: {name}={os.environ[name]!r}: want a positive duration: 30, 30s, 500ms or 2m")
    return f


API = os.environ.get("KETTLE_API", "v0") or "v0"
if API not in ("v0", "v1"):
    raise SystemExit(f"locustfile: KETTLE_API={API!r}: want v0 (case study: login, cookie) or v1 (bearer tokens)")
INTERVAL = _env_seconds("KETTLE_INTERVAL", 30.0)
SECRET = os.environ.get("KETTLE_SECRET", "")
OPERATOR_TOKEN = os.environ.get("KETTLE_OPERATOR_TOKEN", "")
SEED = os.environ.get("KETTLE_SEED", "1")
if API == "v1" and not SECRET and not OPERATOR_TOKEN:
    raise SystemExit(
        "locustfile: KETTLE_API=v1 needs device tokens: set KETTLE_SECRET (derive offline; "
        "kettle serve keeps it in kettle-data/secret) or KETTLE_OPERATOR_TOKEN "
        "(provision through POST /v1/devices; kettle-data/operator-token)"
    )

MAX_BATCH = 1000  # kettle.MaxBatch: readings per v1 upload, and readings a kettle buffers
TOKEN_CONTEXT = b"kettle-device-v1:"

# ---- the kettle: a port of sim/model.go, keep the two in step ----

TARGET_WATER_C = 95.0  # thermostat set point
HEATER_MW = 500_000  # heater power, mW (500 W)
CHARGER_MW = 300_000  # charging power, mW
FILL_ML_PER_S = 5.0  # reservoir fill rate
COOLING_TAU_S = 7200.0  # water → ambient time constant
JOULES_PER_MWH = 3.6
JOULES_PER_C_ML = 4.186  # specific heat of water, J/(g·K)
CUP_ML = 250.0  # one cup, drawn by a person now and then
CUPS_PER_HOUR = 0.5


def _round(x):
    """Go's math.Round: half away from zero (Python's round is half to even)."""
    return math.copysign(math.floor(abs(x) + 0.5), x)


def _whole(x):
    return int(_round(x))


class Model:
    """One kettle's physical state; obeys the last command until the next."""

    def __init__(self, rng, t):
        self.full_mwh = 150_000 + 150_000 * rng.random()
        self.max_ml = 1200 + 800 * rng.random()
        self.base_c = 18 + 6 * rng.random()
        self.swing_c = 1 + 3 * rng.random()
        self.last = t
        self.charge_mwh = self.full_mwh * (0.1 + 0.9 * rng.random())
        self.level_ml = self.max_ml * rng.random()
        self.ambient_c = self.ambient(t)
        self.water_c = self.ambient_c + (TARGET_WATER_C - self.ambient_c) * rng.random()
        self.rate_mw = 0.0
        self.heating = False
        self.charge = self.fill = False  # the command being obeyed
        self.flush_ml_per_s = 0.0

    def ambient(self, t):
        """Room temperature at t (Unix seconds): a daily cycle peaking at 15:00 UTC."""
        h = (t % 86400) / 3600
        return self.base_c + self.swing_c * math.cos(2 * math.pi * (h - 15) / 24)

    def step(self, rng, t):
        """Advance to t under the current command."""
        dt = t - self.last
        if dt <= 0:
            return
        self.last = t
        self.ambient_c = self.ambient(t)

        # Water flows: fill at ambient temperature, flush and cups out.
        before = self.level_ml
        if self.fill:
            self.level_ml = min(self.max_ml, self.level_ml + FILL_ML_PER_S * dt)
        added = self.level_ml - before
        if added > 0:
            self.water_c = (self.water_c * before + self.ambient_c * added) / self.level_ml
        if self.flush_ml_per_s > 0:
            self.level_ml -= min(self.level_ml, self.flush_ml_per_s * dt)
        if rng.random() < 1 - math.exp(-CUPS_PER_HOUR * dt / 3600):
            self.level_ml = max(0.0, self.level_ml - CUP_ML)

        # Heat: Newton cooling toward ambient, heater with hysteresis while
        # there is water and battery.
        self.water_c = self.ambient_c + (self.water_c - self.ambient_c) * math.exp(-dt / COOLING_TAU_S)
        if self.water_c >= TARGET_WATER_C:
            self.heating = False
        elif self.water_c < TARGET_WATER_C - 3:
            self.heating = True
        heat_mwh = 0.0
        if self.heating and self.level_ml > 1 and self.charge_mwh > 0:
            need = (TARGET_WATER_C - self.water_c) * self.level_ml * JOULES_PER_C_ML / JOULES_PER_MWH
            heat_mwh = min(HEATER_MW * dt / 3600, need, self.charge_mwh)
            self.water_c += heat_mwh * JOULES_PER_MWH / (self.level_ml * JOULES_PER_C_ML)
        if self.level_ml <= 1:
            self.water_c = self.ambient_c

        # Battery: the heater draws, the charger adds.
        charge_mwh = 0.0
        if self.charge:
            charge_mwh = max(0.0, min(CHARGER_MW * dt / 3600, self.full_mwh - (self.charge_mwh - heat_mwh)))
        self.charge_mwh = min(self.full_mwh, max(0.0, self.charge_mwh - heat_mwh + charge_mwh))
        self.rate_mw = (charge_mwh - heat_mwh) * 3600 / dt

    def obey(self, rng, t, charge, fill, flush_ml_per_s):
        """Step to t under the old command, then switch to the new one."""
        self.step(rng, t)
        self.charge, self.fill, self.flush_ml_per_s = charge, fill, flush_ml_per_s

    def reading(self):
        """The reading now, rounded as firmware would (whole mWh and mL, 0.01 °C), v1 names."""
        t = datetime.fromtimestamp(self.last, timezone.utc)
        return {
            "time": t.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "battery_charge_mwh": _whole(self.charge_mwh),
            "battery_full_mwh": _whole(self.full_mwh),
            "battery_rate_mw": _whole(self.rate_mw),
            "ambient_temp_c": _round(self.ambient_c * 100) / 100,
            "water_temp_c": _round(self.water_c * 100) / 100,
            "water_level_ml": _whole(self.level_ml),
        }


# v1 field name → case-study field name.
V0_NAMES = {
    "time": "time",
    "battery_charge_mwh": "charge_now",
    "battery_full_mwh": "charge_full",
    "battery_rate_mw": "charge_rate",
    "ambient_temp_c": "ambient_temp",
    "water_temp_c": "water_temp",
    "water_level_ml": "water_level",
}


def device_token(secret, device_id):
    """token.go: "<uuid>." + base64url-no-padding(HMAC-SHA256(secret, "kettle-device-v1:" + uuid))."""
    mac = hmac.new(secret.encode(), TOKEN_CONTEXT + str(device_id).encode(), hashlib.sha256).digest()
    return f"{device_id}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


# ---- shared state of the Locust process ----

_serial = itertools.count()
_provisioned = []  # (id, token) from POST /v1/devices, not yet taken by a kettle
_provisioned_total = 0
_provision_lock = Semaphore()

# Every status reaches the checks below as a normal response: geventhttpclient
# otherwise turns 304/4xx/5xx into exceptions and drops the body (the server's
# message) before we can read it.
_ALL_STATUS = frozenset(range(100, 600))


def _message(r):
    """The server's error message, for the failure line (kept short and stable)."""
    if r.status_code == 0:
        return f"connection error: {getattr(r, 'error', None)}"
    try:
        msg = json.loads(r.content)["message"]
    except Exception:
        msg = (r.text or "").strip()
    return f"HTTP {r.status_code}: {msg[:160]}"


def _retry_after(r):
    try:
        return max(0.0, float(r.headers.get("Retry-After")))
    except (TypeError, ValueError, AttributeError):
        return 1.0 if r.status_code == 503 else 0.0


class Kettle(FastHttpUser):
    """One kettle: posts its reading, then polls its command, every INTERVAL."""

    wait_time = constant_pacing(INTERVAL)
    network_timeout = 10.0  # as kettle swarm's --timeout
    connection_timeout = 10.0
    max_retries = 1  # one attempt; retries are ours, and counted

    def on_start(self):
        self.n = next(_serial)
        worker = getattr(self.environment.runner, "worker_index", 0)  # distinct kettles per --worker
        self.rng = random.Random(f"kettle:{SEED}:{worker}:{self.n}")
        self.model = Model(self.rng, time.time())
        self.pending = []  # readings not yet acknowledged, oldest first (v1 names)
        self.retry_at = 0.0  # no upload or login before this (Unix seconds)
        self.attempts = 0
        self.auth = None  # credential headers, once logged in / provisioned
        self.etag = None
        self.client.client.valid_response_codes = _ALL_STATUS
        # Each kettle ticks at its own phase, so the fleet's load is spread
        # over the interval instead of arriving as one burst per interval.
        gevent.sleep(self.rng.random() * INTERVAL)

    @task
    def tick(self):
        now = time.time()
        next_tick = now + INTERVAL
        self.model.step(self.rng, now)
        if len(self.pending) >= MAX_BATCH:
            self.pending.pop(0)  # firmware buffers are finite: drop the oldest
        self.pending.append(self.model.reading())
        polled = False
        while True:
            if time.time() >= self.retry_at and (self.auth or self.credentials()) and self.pending:
                self.upload()
            if self.auth and not polled:
                self.poll()
                polled = True
            # A failed upload or login is retried within this tick if its
            # backoff ends before the next tick; else a later tick does it.
            work_left = self.pending or not self.auth
            if not work_left or not 0 < self.retry_at < next_tick:
                return
            gevent.sleep(max(0.0, self.retry_at - time.time()))

    def backoff(self, retry_after):
        """Like kettle swarm: exponential from 1 s with jitter, at most the
        interval, at least Retry-After."""
        self.attempts = min(self.attempts + 1, 16)
        back = min(2 ** (self.attempts - 1) * (0.5 + self.rng.random()), INTERVAL)
        self.retry_at = time.time() + max(back, retry_after)

    def ok(self):
        self.attempts, self.retry_at = 0, 0.0

    def failed(self, r):
        """Counts a failed request and decides what the kettle does next."""
        r.failure(_message(r))
        if r.status_code == 401 and API == "v0":
            self.auth = None  # the server does not know us (any more): log in again
        if r.status_code in (400, 413):
            return False  # the reading can never be accepted
        self.backoff(_retry_after(r))
        return True

    # ---- credentials ----

    def credentials(self):
        if API == "v0":
            return self.login()
        if SECRET:
            device_id = uuid.uuid4()
            self.auth = {"Authorization": "Bearer " + device_token(SECRET, device_id)}
            return True
        return self.take_provisioned()

    def login(self):
        body = json.dumps({"username": f"locust-kettle-{self.n}"})
        with self.client.post("/login", data=body, headers={"Content-Type": "application/json"},
                              name="/login", catch_response=True) as r:
            if r.status_code != 200:
                self.failed(r)
                return False
            try:
                device_id = str(uuid.UUID(r.json()["username"]))
            except Exception:
                r.failure(f"bad login body: {(r.text or '')[:80]!r}")
                self.backoff(0)
                return False
            r.success()
        self.ok()
        self.auth = {"servant-auth-cookie": device_id}
        return True

    def take_provisioned(self):
        global _provisioned_total
        with _provision_lock:
            if not _provisioned:
                runner = self.environment.runner
                want = getattr(runner, "target_user_count", None) or 100
                count = max(1, min(MAX_BATCH, want - _provisioned_total))
                with self.client.post("/v1/devices", data=json.dumps({"count": count}),
                                      headers={"Content-Type": "application/json",
                                               "Authorization": "Bearer " + OPERATOR_TOKEN},
                                      name="/v1/devices", catch_response=True) as r:
                    if r.status_code != 201:
                        self.failed(r)
                        return False
                    try:
                        devs = [(d["id"], d["token"]) for d in r.json()["devices"]]
                    except Exception:
                        r.failure(f"bad provisioning body: {(r.text or '')[:80]!r}")
                        self.backoff(0)
                        return False
                    r.success()
                _provisioned.extend(devs)
                _provisioned_total += len(devs)
            _, token = _provisioned.pop()
        self.ok()
        self.auth = {"Authorization": "Bearer " + token}
        return True

    # ---- the exchange ----

    def upload(self):
        """Sends the buffered readings (v0: one per request; v1: up to
        MAX_BATCH in one) until none is left or one fails."""
        while self.pending:
            if API == "v0":
                batch = self.pending[:1]
                body = {V0_NAMES[k]: v for k, v in batch[0].items()}
                path = "/measurement"
            else:
                batch = self.pending[:MAX_BATCH]
                body = batch[0] if len(batch) == 1 else batch
                path = "/v1/measurements"
            headers = {"Content-Type": "application/json", **self.auth}
            with self.client.post(path, data=json.dumps(body, separators=(",", ":")), headers=headers,
                                  name=path, catch_response=True) as r:
                if r.status_code != 200:
                    if self.failed(r):
                        return  # keep the readings for the retry
                    del self.pending[: len(batch)]  # rejected for good
                    continue
                if API == "v1":
                    try:
                        got = r.json()
                        acked = got["stored"] + got["duplicates"]
                    except Exception:
                        acked = -1
                    if acked != len(batch):
                        r.failure(f"sent {len(batch)} readings, server answered {(r.text or '')[:80]!r}")
                        self.backoff(0)
                        return
                r.success()
            del self.pending[: len(batch)]
            self.ok()

    def poll(self):
        """Fetches the command and makes the model obey it."""
        headers = dict(self.auth)
        path = "/command" if API == "v0" else "/v1/command"
        if API == "v1" and self.etag:
            headers["If-None-Match"] = self.etag
        with self.client.get(path, headers=headers, name=path, catch_response=True) as r:
            if r.status_code == 304 and API == "v1":
                r.success()  # unchanged: keep obeying the current command
                return
            if r.status_code != 200:
                r.failure(_message(r))
                if r.status_code == 401 and API == "v0":
                    self.auth = None
                return
            try:
                c = r.json()
                if API == "v0":
                    flush = c["flush"]
                    cmd = (c["charge"] == "ChargeBattery", c["fill"] == "FillReservoir",
                           float(flush.get("contents", 0)) if flush["tag"] == "FlushReservoir" else 0.0)
                else:
                    cmd = (bool(c["charge"]), bool(c["fill"]), float(c["flush_ml_per_s"]))
            except Exception:
                r.failure(f"bad command body: {(r.text or '')[:80]!r}")
                return
            r.success()
            if API == "v1":
                self.etag = r.headers.get("ETag")
        self.model.obey(self.rng, time.time(), *cmd)
