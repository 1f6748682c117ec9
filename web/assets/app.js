// kettlefleet operator dashboard. Vanilla JavaScript, no build step.
// The session cookie is HttpOnly: this script never sees a token; it calls
// the v1 API and the browser sends the cookie.
'use strict';
(() => {
  const REFRESH_MS = 5000;
  const DAY_MS = 24 * 3600 * 1000;
  const HISTORY_PAGES = 30; // ≤ 30,000 readings per kettle chart refresh
  const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

  const $ = (sel, root = document) => root.querySelector(sel);
  const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

  const state = {
    signedIn: false,
    offlineAfterS: 60,
    skewMs: 0, // server clock − browser clock, from the Date header when it matters
    view: null,
    timer: 0,
    busy: false,
    inflight: null,
  };
  const serverNow = () => Date.now() + state.skewMs;

  // ---------- formatting ----------
  const nf = (d) => new Intl.NumberFormat(undefined, { maximumFractionDigits: d, minimumFractionDigits: d });
  const nf0 = nf(0), nf1 = nf(1), nf2 = nf(2);
  const fmtInt = (n) => nf0.format(n);
  const scaled = (v, units) => {
    let i = 0;
    while (i < units.length - 1 && Math.abs(v) >= units[i + 1][0]) i++;
    const x = v / units[i][0];
    return (Math.abs(x) >= 100 ? nf0 : Math.abs(x) >= 10 ? nf1 : nf2).format(x) + ' ' + units[i][1];
  };
  const fmtEnergyMWh = (v) => scaled(v, [[1, 'mWh'], [1e3, 'Wh'], [1e6, 'kWh'], [1e9, 'MWh']]);
  const fmtVolumeML = (v) => scaled(v, [[1, 'mL'], [1e3, 'L'], [1e6, 'm³']]);
  const fmtJoules = (v) => scaled(v, [[1, 'J'], [1e3, 'kJ'], [1e6, 'MJ'], [1e9, 'GJ'], [1e12, 'TJ']]);
  const fmtTemp = (v) => nf1.format(v) + ' °C';
  const fmtMs = (v) => (v >= 100 ? nf0 : nf1).format(v) + ' ms';
  const fmtRate = (v) => (v >= 100 ? nf0 : v >= 10 ? nf1 : nf2).format(v);
  const timeFmt = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', hourCycle: 'h23' });
  const dateTimeFmt = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'medium' });
  const fmtDateTime = (t) => dateTimeFmt.format(new Date(t));
  const ago = (t) => {
    const s = Math.max(0, (serverNow() - t) / 1000);
    if (s < 60) return Math.round(s) + ' s ago';
    if (s < 3600) return Math.round(s / 60) + ' min ago';
    if (s < 86400) return nf1.format(s / 3600) + ' h ago';
    return nf0.format(s / 86400) + ' d ago';
  };
  const pct = (d) => (d && d.latest && d.latest.battery_full_mwh > 0 ? (100 * d.latest.battery_charge_mwh) / d.latest.battery_full_mwh : null);
  // datetime-local inputs hold local wall time without a zone.
  const toLocalInput = (t) => {
    const d = new Date(t - new Date(t).getTimezoneOffset() * 60000);
    return d.toISOString().slice(0, 16);
  };
  const fromLocalInput = (s) => (s ? new Date(s).getTime() : NaN);

  function setStat(name, raw, text, root = document) {
    for (const el of $$(`[data-stat="${name}"]`, root)) {
      el.dataset.value = String(raw);
      el.textContent = text;
      el.title = String(raw);
    }
  }

  // ---------- API ----------
  class APIError extends Error {
    constructor(status, body) {
      super((body && body.message) || `HTTP ${status}`);
      this.status = status;
      this.body = body;
    }
  }

  async function api(path, opts = {}) {
    const init = { method: opts.method || 'GET', credentials: 'same-origin', headers: { Accept: 'application/json' }, cache: 'no-store' };
    if (opts.body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(opts.body);
    }
    const t0 = performance.now();
    let res;
    try {
      res = await fetch(path, init);
    } catch (e) {
      throw new APIError(0, { message: 'kettle serve is not reachable (' + e.message + ')' });
    }
    const ms = performance.now() - t0;
    const date = Date.parse(res.headers.get('Date') || '');
    if (!Number.isNaN(date)) {
      const skew = date - Date.now();
      state.skewMs = Math.abs(skew) > 2000 ? skew : 0; // the header has 1 s resolution
    }
    const body = res.status === 204 ? null : await res.json().catch(() => null);
    if (res.status === 401 && path.startsWith('/v1/')) {
      signedOut('Your session has ended. Sign in again.');
    }
    if (!res.ok) throw new APIError(res.status, body);
    return { body, ms };
  }

  function banner(msg) {
    const b = $('#banner');
    b.textContent = msg || '';
    b.hidden = !msg;
  }

  // ---------- charts (inline SVG) ----------
  const SVG = 'http://www.w3.org/2000/svg';
  function niceScale(min, max, n) {
    if (!(max > min)) {
      const pad = Math.abs(min) * 0.1 || 1;
      min -= pad;
      max += pad;
    }
    const raw = (max - min) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const e = raw / mag;
    const step = (e >= 7.5 ? 10 : e >= 3.5 ? 5 : e >= 1.5 ? 2 : 1) * mag;
    const lo = Math.floor(min / step) * step, hi = Math.ceil(max / step) * step;
    const ticks = [];
    for (let v = lo; v <= hi + step / 2; v += step) ticks.push(Number(v.toFixed(10)));
    return { lo, hi, ticks };
  }

  // Each chart container keeps its options, so it redraws on resize.
  const resizer = typeof ResizeObserver === 'function' ? new ResizeObserver((entries) => {
    for (const e of entries) if (e.target._chart && e.target._chartW !== Math.round(e.contentRect.width)) drawChart(e.target, e.target._chart);
  }) : null;

  // chart draws lines (optionally with a lo–hi band), reference lines and
  // bars on their own scale at the bottom, with a crosshair that follows the
  // pointer or the arrow keys.
  //   opt = {height, x: {min, max, ticks, fmt, tip}, y: {fmt, min, max, unit},
  //          series: [{label, cls, pts: [{x, y, lo, hi}], gap, area}],
  //          refs: [{label, cls, pts: [{x, y}]}], bars: {label, cls, pts, fmt},
  //          label, empty}
  function chart(el, opt) {
    el._chart = opt;
    if (resizer && !el._observed) {
      resizer.observe(el);
      el._observed = true;
    }
    drawChart(el, opt);
  }

  function drawChart(el, opt) {
    const W = Math.max(280, Math.round(el.clientWidth || 600));
    el._chartW = Math.round(el.clientWidth);
    const H = opt.height || 240;
    const m = { l: 48, r: 14, t: 12, b: 26 };
    const pw = W - m.l - m.r, ph = H - m.t - m.b;
    const all = [];
    for (const s of opt.series) for (const p of s.pts) all.push(p.y, p.lo ?? p.y, p.hi ?? p.y);
    for (const r of opt.refs || []) for (const p of r.pts) all.push(p.y);
    const finite = all.filter(Number.isFinite);
    if (!finite.length) {
      el.innerHTML = `<div class="chart-empty">${esc(opt.empty || 'No data yet')}</div>`;
      el.classList.add('is-empty');
      return;
    }
    el.classList.remove('is-empty');
    let ymin = Math.min(...finite), ymax = Math.max(...finite);
    if (opt.y.min !== undefined) ymin = Math.min(ymin, opt.y.min);
    if (opt.y.max !== undefined) ymax = Math.max(ymax, opt.y.max);
    const ys = niceScale(ymin, ymax, Math.max(3, Math.min(6, Math.floor(ph / 40))));
    const X = (x) => m.l + ((x - opt.x.min) / (opt.x.max - opt.x.min || 1)) * pw;
    const Y = (y) => m.t + ph - ((y - ys.lo) / (ys.hi - ys.lo)) * ph;
    const f = (v) => v.toFixed(1);
    const parts = [];
    parts.push(`<svg xmlns="${SVG}" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(opt.label || '')}">`);
    // grid and axes
    for (const t of ys.ticks) {
      parts.push(`<line class="grid" x1="${m.l}" x2="${W - m.r}" y1="${f(Y(t))}" y2="${f(Y(t))}"/>`);
      parts.push(`<text class="axis" x="${m.l - 6}" y="${f(Y(t) + 4)}" text-anchor="end">${esc(opt.y.fmt(t))}</text>`);
    }
    const xt = opt.x.ticks;
    const every = Math.max(1, Math.ceil(xt.length / Math.max(2, Math.floor(pw / 56))));
    xt.forEach((t, i) => {
      if (i % every) return;
      parts.push(`<text class="axis" x="${f(X(t))}" y="${H - 8}" text-anchor="middle">${esc(opt.x.fmt(t))}</text>`);
    });
    // bars on their own scale, bottom quarter
    if (opt.bars && opt.bars.pts.length) {
      const bmax = Math.max(...opt.bars.pts.map((p) => p.y), 1);
      const bw = Math.max(2, (pw / Math.max(1, opt.bars.pts.length)) * 0.6);
      for (const p of opt.bars.pts) {
        if (!(p.y > 0)) continue;
        const h = (p.y / bmax) * ph * 0.16;
        parts.push(`<rect class="bar ${opt.bars.cls}" x="${f(X(p.x) - bw / 2)}" y="${f(m.t + ph - h)}" width="${f(bw)}" height="${f(h)}"/>`);
      }
    }
    // split a series where readings stop for longer than gap
    const segments = (pts, gap) => {
      const out = [];
      let cur = [];
      for (const p of pts) {
        if (!Number.isFinite(p.y)) continue;
        if (cur.length && gap && p.x - cur[cur.length - 1].x > gap) {
          out.push(cur);
          cur = [];
        }
        cur.push(p);
      }
      if (cur.length) out.push(cur);
      return out;
    };
    const path = (pts, key) => pts.map((p, i) => (i ? 'L' : 'M') + f(X(p.x)) + ' ' + f(Y(p[key]))).join('');
    for (const s of opt.series) {
      for (const seg of segments(s.pts, s.gap)) {
        if (seg[0].lo !== undefined) {
          const up = seg.map((p, i) => (i ? 'L' : 'M') + f(X(p.x)) + ' ' + f(Y(p.hi))).join('');
          const down = seg.slice().reverse().map((p) => 'L' + f(X(p.x)) + ' ' + f(Y(p.lo))).join('');
          parts.push(`<path class="band ${s.cls}" d="${up}${down}Z"/>`);
        }
        if (s.area) {
          parts.push(`<path class="area ${s.cls}" d="${path(seg, 'y')}L${f(X(seg[seg.length - 1].x))} ${f(m.t + ph)}L${f(X(seg[0].x))} ${f(m.t + ph)}Z"/>`);
        }
        parts.push(`<path class="line ${s.cls}" d="${path(seg, 'y')}"/>`);
        if (seg.length === 1 || (s.dots && seg.length <= 48)) {
          for (const p of seg) parts.push(`<circle class="dot ${s.cls}" cx="${f(X(p.x))}" cy="${f(Y(p.y))}" r="2.5"/>`);
        }
      }
    }
    for (const r of opt.refs || []) {
      if (r.pts.length) parts.push(`<path class="ref ${r.cls || ''}" d="${path(r.pts, 'y')}"/>`);
    }
    parts.push(`<line class="axis-line" x1="${m.l}" x2="${W - m.r}" y1="${m.t + ph}" y2="${m.t + ph}"/>`);
    parts.push(`<g class="cross" visibility="hidden"><line class="crossline" y1="${m.t}" y2="${m.t + ph}"/></g>`);
    parts.push(`<rect class="hit" x="${m.l}" y="${m.t}" width="${pw}" height="${ph}" fill="transparent"/>`);
    parts.push('</svg><div class="tip" hidden></div>');
    el.innerHTML = parts.join('');
    el.tabIndex = 0;
    el.setAttribute('aria-label', (opt.label || 'Chart') + '. Use the left and right arrow keys to read values.');

    // crosshair
    const xs = [...new Set(opt.series.flatMap((s) => s.pts.map((p) => p.x)))].sort((a, b) => a - b);
    const svg = el.firstChild, cross = svg.querySelector('.cross'), line = cross.firstChild, tip = el.lastChild;
    const show = (i) => {
      if (i < 0 || i >= xs.length) return;
      el._idx = i;
      const x = xs[i], px = X(x);
      line.setAttribute('x1', px);
      line.setAttribute('x2', px);
      cross.querySelectorAll('circle').forEach((c) => c.remove());
      const rows = [];
      for (const s of opt.series) {
        const p = s.pts.find((q) => q.x === x);
        if (!p || !Number.isFinite(p.y)) continue;
        const c = document.createElementNS(SVG, 'circle');
        c.setAttribute('class', 'hover ' + s.cls);
        c.setAttribute('cx', px);
        c.setAttribute('cy', Y(p.y));
        c.setAttribute('r', 4);
        cross.appendChild(c);
        const band = p.lo !== undefined ? ` ± ${opt.y.fmt(p.hi - p.y)}` : '';
        rows.push(`<div><span class="sw ${s.cls}"></span>${esc(s.label)} <b>${esc(opt.y.fmt(p.y))}${esc(band)}</b>${esc(opt.y.unit || '')}</div>`);
      }
      for (const r of opt.refs || []) {
        const p = r.pts.find((q) => q.x === x) || r.pts[r.pts.length - 1];
        if (p && r.tip) rows.push(`<div><span class="sw ${r.cls}"></span>${esc(r.label)} <b>${esc(opt.y.fmt(p.y))}</b>${esc(opt.y.unit || '')}</div>`);
      }
      if (opt.bars) {
        const p = opt.bars.pts.find((q) => q.x === x);
        if (p) rows.push(`<div><span class="sw ${opt.bars.cls}"></span>${esc(opt.bars.label)} <b>${esc(opt.bars.fmt(p.y))}</b></div>`);
      }
      cross.setAttribute('visibility', 'visible');
      tip.innerHTML = `<div class="tip-h">${esc(opt.x.tip(x))}</div>` + rows.join('');
      tip.hidden = false;
      const tw = tip.offsetWidth;
      tip.style.left = Math.min(Math.max(0, px + 12), W - tw - 4) + 'px';
      if (px + 12 + tw > W) tip.style.left = Math.max(0, px - tw - 12) + 'px';
      tip.style.top = m.t + 'px';
    };
    const hide = () => {
      cross.setAttribute('visibility', 'hidden');
      tip.hidden = true;
    };
    const nearest = (px) => {
      const x = opt.x.min + ((px - m.l) / pw) * (opt.x.max - opt.x.min);
      let lo = 0, hi = xs.length - 1;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (xs[mid] < x) lo = mid + 1;
        else hi = mid;
      }
      return lo > 0 && Math.abs(xs[lo - 1] - x) < Math.abs(xs[lo] - x) ? lo - 1 : lo;
    };
    svg.addEventListener('pointermove', (e) => {
      const r = svg.getBoundingClientRect();
      show(nearest(e.clientX - r.left));
    });
    svg.addEventListener('pointerleave', hide);
    el.onkeydown = (e) => {
      if (e.key !== 'ArrowLeft' && e.key !== 'ArrowRight') return;
      e.preventDefault();
      const i = el._idx === undefined ? xs.length - 1 : el._idx + (e.key === 'ArrowRight' ? 1 : -1);
      show(Math.max(0, Math.min(xs.length - 1, i)));
    };
    el.onblur = hide;
  }

  function sparkline(el, values) {
    const W = 120, H = 28;
    const v = values.filter(Number.isFinite);
    if (v.length < 2) {
      el.innerHTML = '';
      return;
    }
    const lo = Math.min(...v), hi = Math.max(...v);
    const span = hi - lo || 1;
    const pts = v.map((y, i) => [(i / (v.length - 1)) * W, H - 2 - ((y - lo) / span) * (H - 4)]);
    const d = pts.map((p, i) => (i ? 'L' : 'M') + p[0].toFixed(1) + ' ' + p[1].toFixed(1)).join('');
    el.innerHTML = `<svg xmlns="${SVG}" viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" width="100%" height="${H}"><path class="spark-area" d="${d}L${W} ${H}L0 ${H}Z"/><path class="spark-line" d="${d}"/></svg>`;
  }

  // ---------- views ----------
  function mountTemplate(id) {
    const main = $('#main');
    main.replaceChildren($(id).content.cloneNode(true));
    return main.firstElementChild;
  }

  // Fleet: live statistics, rates, and temperature by hour.
  const fleetView = {
    range: { preset: 'all', from: NaN, to: NaN },
    samples: [], // {t, count, ms}
    mount(root) {
      this.root = root;
      const f = $('#range', root);
      const preset = $('#preset', root), from = $('#from', root), to = $('#to', root);
      preset.value = this.range.preset;
      const syncInputs = () => {
        const custom = preset.value === 'custom';
        from.disabled = to.disabled = !custom;
        if (!custom) {
          const r = this.rangeTimes(preset.value);
          from.value = Number.isFinite(r.from) ? toLocalInput(r.from) : '';
          to.value = '';
        }
      };
      if (this.range.preset === 'custom') {
        from.value = Number.isFinite(this.range.from) ? toLocalInput(this.range.from) : '';
        to.value = Number.isFinite(this.range.to) ? toLocalInput(this.range.to) : '';
      }
      syncInputs();
      preset.addEventListener('change', () => {
        syncInputs();
        if (preset.value !== 'custom') {
          this.range = { preset: preset.value, from: NaN, to: NaN };
          this.refresh();
        } else {
          from.focus();
        }
      });
      f.addEventListener('submit', (e) => {
        e.preventDefault();
        const r = { preset: preset.value, from: NaN, to: NaN };
        if (r.preset === 'custom') {
          r.from = fromLocalInput(from.value);
          r.to = fromLocalInput(to.value);
          if (Number.isFinite(r.from) && Number.isFinite(r.to) && r.to <= r.from) {
            banner('The end of the range must be after its start.');
            return;
          }
        }
        banner('');
        this.range = r;
        this.refresh();
      });
    },
    rangeTimes(preset) {
      if (preset === 'custom') return { from: this.range.from, to: this.range.to };
      if (preset === 'all') return { from: NaN, to: NaN };
      return { from: serverNow() - Number(preset) * DAY_MS, to: NaN };
    },
    label() {
      const r = this.rangeTimes(this.range.preset);
      if (!Number.isFinite(r.from) && !Number.isFinite(r.to)) return 'All time';
      const a = Number.isFinite(r.from) ? fmtDateTime(r.from) : 'the beginning';
      const b = Number.isFinite(r.to) ? fmtDateTime(r.to) : 'now';
      return `${a} – ${b}`;
    },
    async refresh() {
      const r = this.rangeTimes(this.range.preset);
      const q = new URLSearchParams();
      if (Number.isFinite(r.from)) q.set('from', new Date(r.from).toISOString());
      if (Number.isFinite(r.to)) q.set('to', new Date(r.to).toISOString());
      const { body: s, ms } = await api('/v1/statistics' + (q.toString() ? '?' + q : ''));
      if (state.view !== this) return;
      this.render(s, ms);
    },
    render(s, ms) {
      const root = this.root;
      const now = performance.now();
      const prev = this.samples[this.samples.length - 1];
      const sample = { t: now, count: s.measurement_count, ms, mps: NaN };
      if (prev && now > prev.t && s.measurement_count >= prev.count) sample.mps = ((s.measurement_count - prev.count) * 1000) / (now - prev.t);
      this.samples.push(sample);
      if (this.samples.length > 60) this.samples.shift();

      $('#range-label', root).textContent = this.label();
      setStat('measurement_count', s.measurement_count, fmtInt(s.measurement_count), root);
      setStat('range_measurement_count', s.range_measurement_count, fmtInt(s.range_measurement_count), root);
      setStat('devices_registered', s.devices_registered, fmtInt(s.devices_registered), root);
      setStat('devices_reporting', s.devices_reporting, fmtInt(s.devices_reporting), root);
      setStat('total_battery_charge_mwh', s.total_battery_charge_mwh, fmtEnergyMWh(s.total_battery_charge_mwh), root);
      setStat('total_water_volume_ml', s.total_water_volume_ml, fmtVolumeML(s.total_water_volume_ml), root);
      setStat('total_potential_energy_j', s.total_potential_energy_j, fmtJoules(s.total_potential_energy_j), root);
      setStat('total_potential_energy_c_ml', s.total_potential_energy_c_ml, fmtInt(s.total_potential_energy_c_ml), root);
      const meter = $('#reporting-meter', root);
      meter.value = s.devices_registered ? s.devices_reporting / s.devices_registered : 0;
      $('#reporting-sub', root).textContent = `reporting in the last ${Math.round(s.reporting_window_s / 60)} min / registered`;
      const per = (v, f) => (s.devices_reporting > 0 ? `${f(v / s.devices_reporting)} per reporting kettle` : 'no kettle reporting');
      $('#charge-sub', root).textContent = per(s.total_battery_charge_mwh, fmtEnergyMWh);
      $('#water-sub', root).textContent = per(s.total_water_volume_ml, fmtVolumeML);

      $('#mps', root).textContent = Number.isFinite(sample.mps) ? fmtRate(sample.mps) : 'measuring…';
      $('#latency', root).textContent = fmtMs(ms);
      sparkline($('#mps-spark', root), this.samples.map((x) => x.mps));
      sparkline($('#lat-spark', root), this.samples.map((x) => x.ms));

      const hours = s.temperature_by_hour || [];
      const has = hours.filter((h) => h.count > 0);
      const hourPts = (key) => has.map((h) => ({ x: h.hour, y: h[key].mean, lo: h[key].mean - h[key].stddev, hi: h[key].mean + h[key].stddev }));
      chart($('#hour-chart', root), {
        height: 280,
        label: 'Water and ambient temperature by hour of day (UTC): mean with a band of one standard deviation',
        empty: 'No readings in this range yet',
        x: { min: -0.5, max: 23.5, ticks: [...Array(24).keys()], fmt: (h) => String(h).padStart(2, '0') + 'h', tip: (h) => `${String(h).padStart(2, '0')}:00–${String(h).padStart(2, '0')}:59 UTC` },
        y: { fmt: (v) => (Number.isInteger(v) ? nf0 : nf1).format(v), unit: ' °C' },
        series: [
          { label: 'Water', cls: 's-water', pts: hourPts('water_temp_c'), gap: 1.5, dots: true },
          { label: 'Ambient', cls: 's-ambient', pts: hourPts('ambient_temp_c'), gap: 1.5, dots: true },
        ],
        bars: { label: 'Readings', cls: 's-count', pts: hours.map((h) => ({ x: h.hour, y: h.count })), fmt: fmtInt },
      });
      $('#hour-table tbody', root).innerHTML = hours.map((h) => h.count > 0
        ? `<tr data-hour="${h.hour}" data-water-mean="${h.water_temp_c.mean}" data-water-sd="${h.water_temp_c.stddev}" data-ambient-mean="${h.ambient_temp_c.mean}" data-ambient-sd="${h.ambient_temp_c.stddev}" data-count="${h.count}"><th scope="row">${String(h.hour).padStart(2, '0')}:00</th><td class="num">${fmtInt(h.count)}</td><td class="num">${nf2.format(h.water_temp_c.mean)}</td><td class="num">${nf2.format(h.water_temp_c.stddev)}</td><td class="num">${nf2.format(h.ambient_temp_c.mean)}</td><td class="num">${nf2.format(h.ambient_temp_c.stddev)}</td></tr>`
        : `<tr data-hour="${h.hour}" data-count="0"><th scope="row">${String(h.hour).padStart(2, '0')}:00</th><td class="num">0</td><td class="num muted" colspan="4">no readings</td></tr>`).join('');
    },
  };

  // Device status from last_seen.
  function status(d) {
    if (!d.last_seen) return { cls: 'never', text: 'Never reported' };
    const age = serverNow() - Date.parse(d.last_seen);
    return age > state.offlineAfterS * 1000 ? { cls: 'offline', text: 'Offline' } : { cls: 'online', text: 'Online' };
  }

  // The smallest id with a given hex prefix, minus one: the API's `after`
  // cursor that starts a listing exactly at the prefix.
  function prefixCursor(prefix) {
    const hex = prefix.padEnd(32, '0').split('');
    let i = 31;
    while (i >= 0 && hex[i] === '0') hex[i--] = 'f';
    if (i < 0) return '';
    hex[i] = (parseInt(hex[i], 16) - 1).toString(16);
    const h = hex.join('');
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  // Devices: a cursor-paginated list, searchable by id prefix.
  const devicesView = {
    q: '',
    sort: 'id',
    dir: 1,
    size: 50,
    cursors: [''], // cursors[i] is the `after` of page i
    page: 0,
    next: '',
    rows: [],
    mount(root) {
      this.root = root;
      const q = $('#q', root), sort = $('#sort', root), size = $('#size', root);
      q.value = this.q;
      sort.value = this.sort;
      size.value = String(this.size);
      let debounce = 0;
      q.addEventListener('input', () => {
        clearTimeout(debounce);
        debounce = setTimeout(() => this.search(q.value), 250);
      });
      $('#dev-tools', root).addEventListener('submit', (e) => {
        e.preventDefault();
        this.search(q.value);
      });
      sort.addEventListener('change', () => {
        this.sort = sort.value;
        this.dir = 1;
        this.draw();
      });
      size.addEventListener('change', () => {
        this.size = Number(size.value);
        this.cursors = [this.cursors[0]];
        this.page = 0;
        this.refresh();
      });
      $$('th[data-key] button', root).forEach((b) => b.addEventListener('click', () => {
        const key = b.parentElement.dataset.key;
        if (this.sort === key) this.dir = -this.dir;
        else {
          this.sort = key;
          this.dir = 1;
        }
        sort.value = key;
        this.draw();
      }));
      $('#prev', root).addEventListener('click', () => {
        if (this.page > 0) {
          this.page--;
          this.refresh();
        }
      });
      $('#next', root).addEventListener('click', () => {
        if (this.next) {
          this.cursors[this.page + 1] = this.next;
          this.page++;
          this.refresh();
        }
      });
    },
    normPrefix(s) {
      return s.toLowerCase().replace(/[^0-9a-f]/g, '').slice(0, 32);
    },
    search(value) {
      const p = this.normPrefix(value);
      if (p === this.q) return;
      this.q = p;
      this.cursors = [p ? prefixCursor(p) : ''];
      this.page = 0;
      this.refresh();
    },
    async refresh() {
      const q = new URLSearchParams({ limit: String(this.size) });
      const after = this.cursors[this.page];
      if (after) q.set('after', after);
      const { body } = await api('/v1/devices?' + q);
      if (state.view !== this) return;
      let devs = body.devices || [];
      let next = body.next || '';
      if (this.q) {
        const match = (d) => d.id.replace(/-/g, '').startsWith(this.q);
        const n = devs.length;
        devs = devs.filter(match);
        if (devs.length < n) next = ''; // ids are ordered: past the prefix, done
      }
      this.rows = devs;
      this.next = next;
      this.draw();
    },
    draw() {
      const root = this.root;
      const key = this.sort, dir = this.dir;
      const val = {
        id: (d) => d.id,
        last_seen: (d) => (d.last_seen ? -Date.parse(d.last_seen) : Infinity),
        battery: (d) => pct(d) ?? Infinity,
        level: (d) => (d.latest ? d.latest.water_level_ml : Infinity),
      }[key];
      const rows = this.rows.slice().sort((a, b) => {
        const x = val(a), y = val(b);
        return (x < y ? -1 : x > y ? 1 : 0) * dir || (a.id < b.id ? -1 : 1);
      });
      $$('th[data-key]', root).forEach((th) => {
        if (th.dataset.key === key) th.setAttribute('aria-sort', (key === 'last_seen' ? -dir : dir) > 0 ? 'ascending' : 'descending');
        else th.removeAttribute('aria-sort');
      });
      const tbody = $('#dev-table tbody', root);
      if (!rows.length) {
        tbody.innerHTML = `<tr><td colspan="8" class="empty">${this.q ? 'No kettle id starts with “' + esc(this.q) + '”.' : 'No kettles registered yet. Provision some with POST /v1/devices.'}</td></tr>`;
      } else {
        tbody.innerHTML = rows.map((d) => {
          const st = status(d);
          const L = d.latest;
          const p = pct(d);
          const cap = d.capacity_ml > 0 ? d.capacity_ml : 0;
          return `<tr data-id="${esc(d.id)}" class="${st.cls}">
            <td><a class="id" href="#/devices/${esc(d.id)}"><code>${esc(d.id.slice(0, 8))}</code><span class="id-rest">${esc(d.id.slice(8))}</span></a></td>
            <td><span class="status ${st.cls}">${st.text}</span></td>
            <td class="nowrap" ${d.last_seen ? `title="${esc(fmtDateTime(Date.parse(d.last_seen)))}"` : ''}>${d.last_seen ? ago(Date.parse(d.last_seen)) : '—'}</td>
            <td class="nowrap">${p === null ? '—' : `<meter class="mini" min="0" max="100" low="25" high="60" optimum="100" value="${p.toFixed(1)}" aria-hidden="true"></meter> ${nf0.format(p)} %`}</td>
            <td class="nowrap">${L ? `${cap ? `<meter class="mini" min="0" max="1" low="0.2" high="0.5" optimum="1" value="${Math.min(1, L.water_level_ml / cap).toFixed(3)}" aria-hidden="true"></meter> ` : ''}${fmtVolumeML(L.water_level_ml)}` : '—'}</td>
            <td class="num hide-sm">${L ? fmtTemp(L.water_temp_c) : '—'}</td>
            <td class="num hide-sm">${L ? fmtTemp(L.ambient_temp_c) : '—'}</td>
            <td class="num hide-md">${fmtInt(d.measurements)}</td></tr>`;
        }).join('');
      }
      const counts = { online: 0, offline: 0, never: 0 };
      for (const d of this.rows) counts[status(d).cls]++;
      const first = this.page * this.size + 1;
      $('#page-label', root).textContent = this.rows.length ? `Page ${this.page + 1} · ${fmtInt(first)}–${fmtInt(first + this.rows.length - 1)}` : `Page ${this.page + 1}`;
      $('#dev-summary', root).textContent = `This page: ${counts.online} online · ${counts.offline} offline · ${counts.never} never reported` + (this.q ? ` · ids starting with ${this.q}` : '');
      $('#prev', root).disabled = this.page === 0;
      $('#next', root).disabled = !this.next;
    },
  };

  // One kettle: state, command and why, override, the last 24 h.
  const deviceView = {
    id: '',
    hist: [],
    histFrom: 0,
    histTruncated: false,
    mount(root, id) {
      this.root = root;
      if (this.id !== id) {
        this.hist = [];
        this.histFrom = 0;
      }
      this.id = id;
      $('#kettle-id', root).textContent = id;
      $('#crumb-id', root).textContent = id.slice(0, 8);
      const form = $('#override', root);
      const flush = $('#ov-flush', root), rate = $('#ov-rate', root), forSel = $('#ov-for', root), until = $('#ov-until', root);
      flush.addEventListener('change', () => {
        rate.disabled = flush.value !== 'rate';
      });
      forSel.addEventListener('change', () => {
        until.disabled = forSel.value !== 'custom';
        if (!until.disabled) {
          if (!until.value) until.value = toLocalInput(Date.now() + 3600e3);
          until.focus();
        }
      });
      form.addEventListener('submit', (e) => {
        e.preventDefault();
        this.applyOverride();
      });
      $('#ov-clear', root).addEventListener('click', () => this.clearOverride());
    },
    overrideBody() {
      const root = this.root;
      const body = {};
      const tri = (v) => (v === '' ? undefined : v === 'true');
      const charge = tri($('#ov-charge', root).value), fill = tri($('#ov-fill', root).value);
      if (charge !== undefined) body.charge = charge;
      if (fill !== undefined) body.fill = fill;
      const flush = $('#ov-flush', root).value;
      if (flush === 'off') body.flush_ml_per_s = 0;
      if (flush === 'rate') {
        const r = Number($('#ov-rate', root).value);
        if (!(r > 0 && r <= 1000)) return { error: 'Flush rate: enter a rate from 0.1 to 1000 mL/s.' };
        body.flush_ml_per_s = r;
      }
      if (body.charge === undefined && body.fill === undefined && body.flush_ml_per_s === undefined) {
        return { error: 'Choose at least one of charge, fill or flush to force.' };
      }
      const forv = $('#ov-for', root).value;
      const exp = forv === 'custom' ? fromLocalInput($('#ov-until', root).value) : Date.now() + Number(forv) * 60e3;
      if (!Number.isFinite(exp) || exp <= Date.now()) return { error: 'Expires at: choose a time in the future.' };
      body.expires_at = new Date(exp + state.skewMs).toISOString();
      return { body };
    },
    async applyOverride() {
      const root = this.root;
      const err = $('#ov-error', root), ok = $('#ov-ok', root);
      err.textContent = ok.textContent = '';
      const { body, error } = this.overrideBody();
      if (error) {
        err.textContent = error;
        return;
      }
      try {
        const { body: d } = await api(`/v1/devices/${this.id}/override`, { method: 'PUT', body });
        if (state.view !== this) return;
        this.renderDevice(d);
        ok.textContent = 'Override applied.';
      } catch (e) {
        err.textContent = fieldErrors(e);
      }
    },
    async clearOverride() {
      const root = this.root;
      const err = $('#ov-error', root), ok = $('#ov-ok', root);
      err.textContent = ok.textContent = '';
      try {
        await api(`/v1/devices/${this.id}/override`, { method: 'DELETE' });
        const { body: d } = await api(`/v1/devices/${this.id}`);
        if (state.view !== this) return;
        this.renderDevice(d);
        ok.textContent = 'Override cleared: the policy decides.';
      } catch (e) {
        err.textContent = fieldErrors(e);
      }
    },
    async refresh() {
      const id = this.id;
      const { body: d } = await api(`/v1/devices/${id}`);
      if (state.view !== this || this.id !== id) return;
      this.renderDevice(d);
      await this.loadHistory();
      if (state.view !== this || this.id !== id) return;
      this.renderCharts(d);
    },
    // loadHistory fetches the last 24 h once, then only what is new.
    async loadHistory() {
      const id = this.id;
      const from = serverNow() - DAY_MS;
      let after = this.hist.length ? this.hist[this.hist.length - 1].time : '';
      const start = after ? '' : new Date(from).toISOString();
      let pages = 0;
      this.histTruncated = false;
      for (;;) {
        const q = new URLSearchParams({ limit: '1000' });
        if (start) q.set('from', start);
        if (after) q.set('after', after);
        const { body } = await api(`/v1/devices/${id}/measurements?${q}`);
        if (this.id !== id) return;
        for (const m of body.measurements || []) {
          m.t = Date.parse(m.time);
          this.hist.push(m);
        }
        after = body.next;
        if (!after) break;
        if (++pages >= HISTORY_PAGES) {
          this.histTruncated = true;
          break;
        }
      }
      let cut = 0;
      while (cut < this.hist.length && this.hist[cut].t < from) cut++;
      if (cut) this.hist.splice(0, cut);
    },
    renderDevice(d) {
      const root = this.root;
      this.device = d;
      const st = status(d);
      const s = $('#kettle-status', root);
      s.className = 'status ' + st.cls;
      s.textContent = st.text;
      $('#kettle-seen', root).textContent = d.last_seen ? `· last reading stored ${ago(Date.parse(d.last_seen))} · ${fmtInt(d.measurements)} readings · registered ${fmtDateTime(Date.parse(d.registered_at))}` : `· registered ${fmtDateTime(Date.parse(d.registered_at))}, no reading yet`;
      const L = d.latest;
      const p = pct(d);
      $('#k-battery', root).textContent = p === null ? '–' : nf0.format(p) + ' %';
      $('#k-battery-m', root).value = p ?? 0;
      $('#k-battery-sub', root).textContent = L ? `${fmtEnergyMWh(L.battery_charge_mwh)} of ${fmtEnergyMWh(L.battery_full_mwh)} · ${L.battery_rate_mw > 0 ? 'charging' : L.battery_rate_mw < 0 ? 'discharging' : 'idle'} ${nf0.format(Math.abs(L.battery_rate_mw))} mW` : 'no reading yet';
      $('#k-level', root).textContent = L ? fmtVolumeML(L.water_level_ml) : '–';
      $('#k-level-m', root).value = L && d.capacity_ml > 0 ? Math.min(1, L.water_level_ml / d.capacity_ml) : 0;
      $('#k-level-sub', root).textContent = d.capacity_ml > 0 ? `of ${fmtVolumeML(d.capacity_ml)} capacity (largest level reported)` : 'capacity not known yet';
      $('#k-water', root).textContent = L ? fmtTemp(L.water_temp_c) : '–';
      $('#k-ambient', root).textContent = L ? fmtTemp(L.ambient_temp_c) : '–';
      $('#k-water-sub', root).textContent = L ? `${nf1.format(L.water_temp_c - L.ambient_temp_c)} °C above ambient` : '';
      $('#k-ambient-sub', root).textContent = L ? `reading of ${fmtDateTime(Date.parse(L.time))}` : '';

      const c = d.command;
      const chip = (el, on, text) => {
        el.className = 'chip ' + (on ? 'on' : 'off');
        el.textContent = text;
      };
      if (c) {
        chip($('#cmd-charge', root), c.charge, c.charge ? 'Charging' : 'Not charging');
        chip($('#cmd-fill', root), c.fill, c.fill ? 'Filling' : 'Not filling');
        chip($('#cmd-flush', root), c.flush_ml_per_s > 0, c.flush_ml_per_s > 0 ? `Dispensing ${nf1.format(c.flush_ml_per_s)} mL/s` : 'Off');
        $('#cmd-reason', root).textContent = c.reason;
        $('#cmd-poll', root).textContent = `The kettle is told to poll again within ${c.poll_after_s} s.`;
      }
      const o = d.override;
      const ovState = $('#ov-state', root);
      if (o && o.active) {
        const set = [];
        if (o.charge !== undefined) set.push(`charge ${o.charge ? 'on' : 'off'}`);
        if (o.fill !== undefined) set.push(`fill ${o.fill ? 'on' : 'off'}`);
        if (o.flush_ml_per_s !== undefined) set.push(o.flush_ml_per_s > 0 ? `flush ${nf1.format(o.flush_ml_per_s)} mL/s` : 'flush off');
        ovState.textContent = `Active: ${set.join(', ')} until ${fmtDateTime(Date.parse(o.expires_at))}.`;
        ovState.className = 'ov-active small';
      } else if (o) {
        ovState.textContent = `The last override expired ${fmtDateTime(Date.parse(o.expires_at))}; the policy decides.`;
        ovState.className = 'muted small';
      } else {
        ovState.textContent = 'No override: the policy decides.';
        ovState.className = 'muted small';
      }
      $('#ov-clear', root).disabled = !o;
    },
    renderCharts(d) {
      const root = this.root;
      const now = serverNow();
      const x0 = now - DAY_MS;
      // Average into at most ~360 buckets: a line chart, not a scatter of 3,000 points.
      const n = 360, w = DAY_MS / n;
      const buckets = new Map();
      for (const m of this.hist) {
        const k = Math.floor((m.t - x0) / w);
        let b = buckets.get(k);
        if (!b) buckets.set(k, (b = { n: 0, t: 0, water: 0, ambient: 0, level: 0, charge: 0, full: 0 }));
        b.n++;
        b.t += m.t;
        b.water += m.water_temp_c;
        b.ambient += m.ambient_temp_c;
        b.level += m.water_level_ml;
        b.charge += m.battery_charge_mwh;
        b.full += m.battery_full_mwh;
      }
      const pts = [...buckets.values()].map((b) => ({ x: b.t / b.n, water: b.water / b.n, ambient: b.ambient / b.n, level: b.level / b.n, charge: b.charge / b.n, full: b.full / b.n })).sort((a, b) => a.x - b.x);
      const series = (key) => pts.map((p) => ({ x: p.x, y: p[key] }));
      const ticks = [];
      const h0 = new Date(x0);
      h0.setMinutes(0, 0, 0);
      for (let t = h0.getTime() + 3600e3; t <= now; t += 3 * 3600e3) ticks.push(t);
      const x = { min: x0, max: now, ticks, fmt: (t) => timeFmt.format(new Date(t)), tip: (t) => fmtDateTime(t) };
      // A gap of more than 3 polls (or 3 buckets) breaks the line.
      const gap = Math.max(3 * w, 3 * state.offlineAfterS * 500);
      const empty = 'No readings in the last 24 hours';
      chart($('#c-temp', root), { label: 'Water and ambient temperature, last 24 hours', empty, x, y: { fmt: (v) => nf0.format(v), unit: ' °C' }, series: [
        { label: 'Water', cls: 's-water', pts: series('water'), gap },
        { label: 'Ambient', cls: 's-ambient', pts: series('ambient'), gap },
      ] });
      chart($('#c-level', root), { label: 'Water level, last 24 hours', empty, x, y: { fmt: (v) => fmtInt(v), unit: ' mL', min: 0 }, series: [
        { label: 'Level', cls: 's-level', pts: series('level'), gap, area: true },
      ], refs: d.capacity_ml > 0 && pts.length ? [{ label: 'Capacity', cls: 's-ref', tip: true, pts: [{ x: x0, y: d.capacity_ml }, { x: now, y: d.capacity_ml }] }] : [] });
      chart($('#c-battery', root), { label: 'Battery charge, last 24 hours', empty, x, y: { fmt: (v) => fmtInt(v), unit: ' mWh', min: 0 }, series: [
        { label: 'Charge', cls: 's-battery', pts: series('charge'), gap, area: true },
      ], refs: pts.length ? [{ label: 'Full', cls: 's-ref', tip: true, pts: series('full') }] : [] });
      $('#hist-note', root).textContent = this.histTruncated
        ? `Showing the first ${fmtInt(this.hist.length)} readings of the last 24 h.`
        : `${fmtInt(this.hist.length)} readings in the last 24 h; times in your local time zone.`;
    },
  };

  function fieldErrors(e) {
    if (e.body && Array.isArray(e.body.fields) && e.body.fields.length) {
      return e.body.fields.map((f) => `${f.field}: ${f.message}`).join('; ');
    }
    return e.message;
  }

  // ---------- routing and the live loop ----------
  function route() {
    const h = location.hash.replace(/^#\/?/, '');
    const m = /^devices\/([^/?]+)$/.exec(h);
    if (m && UUID_RE.test(m[1])) return { view: deviceView, tpl: '#t-device', arg: m[1].toLowerCase(), nav: 'devices' };
    if (h.startsWith('devices')) return { view: devicesView, tpl: '#t-devices', nav: 'devices' };
    return { view: fleetView, tpl: '#t-fleet', nav: 'fleet' };
  }

  function render() {
    if (!state.signedIn) return;
    const r = route();
    banner('');
    state.view = r.view;
    const root = mountTemplate(r.tpl);
    r.view.mount(root, r.arg);
    for (const a of $$('[data-nav]')) {
      if (a.dataset.nav === r.nav) a.setAttribute('aria-current', 'page');
      else a.removeAttribute('aria-current');
    }
    document.title = (r.view === fleetView ? 'Fleet' : r.view === devicesView ? 'Devices' : 'Kettle ' + r.arg.slice(0, 8)) + ' · kettlefleet';
    const h1 = $('h1', root);
    if (h1 && state.routed) h1.focus({ preventScroll: true });
    state.routed = true;
    tick(true);
  }

  async function tick(now) {
    clearTimeout(state.timer);
    state.timer = 0;
    if (!state.signedIn) return;
    if (document.hidden) {
      setLive('paused');
      return;
    }
    if (state.busy && !now) {
      state.timer = setTimeout(tick, REFRESH_MS);
      return;
    }
    const view = state.view;
    state.busy = true;
    try {
      state.inflight = view.refresh();
      await state.inflight;
      if (state.view === view) {
        banner('');
        setLive('live');
      }
    } catch (e) {
      if (state.signedIn) {
        banner(e instanceof APIError ? `Could not refresh: ${e.message}` : `Could not refresh: ${e}`);
        setLive('error');
      }
    } finally {
      state.busy = false;
    }
    if (state.signedIn && !document.hidden && !state.timer) state.timer = setTimeout(tick, REFRESH_MS);
  }

  function setLive(mode) {
    const el = $('#live');
    el.dataset.mode = mode;
    $('#live-text').textContent = mode === 'paused' ? 'Paused' : mode === 'error' ? 'Retrying' : 'Live · ' + timeFmt.format(new Date());
    el.title = mode === 'paused' ? 'Refresh pauses while the tab is hidden' : 'Refreshes every ' + REFRESH_MS / 1000 + ' s';
  }

  document.addEventListener('visibilitychange', () => {
    if (!state.signedIn) return;
    if (document.hidden) {
      clearTimeout(state.timer);
      state.timer = 0;
      setLive('paused');
    } else {
      tick(true);
    }
  });
  window.addEventListener('hashchange', render);

  // ---------- sessions ----------
  function showSignIn(message) {
    state.signedIn = false;
    clearTimeout(state.timer);
    state.timer = 0;
    state.view = null;
    // Forget everything of the fleet this page held.
    fleetView.samples = [];
    deviceView.hist = [];
    deviceView.id = '';
    devicesView.rows = [];
    $('#top').hidden = true;
    banner('');
    const root = mountTemplate('#t-signin');
    document.title = 'Sign in · kettlefleet';
    const form = $('#signin-form', root), input = $('#token', root), err = $('#signin-error', root);
    if (message) err.textContent = message;
    input.focus();
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      err.textContent = '';
      const token = input.value.trim();
      if (!token) {
        err.textContent = 'Enter the operator token.';
        input.focus();
        return;
      }
      const btn = $('button[type=submit]', form);
      btn.disabled = true;
      try {
        const res = await fetch('/session', { method: 'POST', credentials: 'same-origin', headers: { 'Content-Type': 'application/json', Accept: 'application/json' }, body: JSON.stringify({ token }) });
        const body = await res.json().catch(() => ({}));
        if (!res.ok) {
          err.textContent = res.status === 401 ? 'That is not the operator token.' : body.message || `Sign-in failed (HTTP ${res.status}).`;
          input.select();
          return;
        }
        input.value = '';
        signedIn(body);
      } catch (e2) {
        err.textContent = 'kettle serve is not reachable.';
      } finally {
        btn.disabled = false;
      }
    });
  }

  function signedIn(info) {
    state.signedIn = true;
    state.routed = false;
    if (info.offline_after_s > 0) state.offlineAfterS = info.offline_after_s;
    $('#top').hidden = false;
    render();
  }

  function signedOut(message) {
    if (state.signedIn) showSignIn(message);
  }

  $('#signout').addEventListener('click', async () => {
    state.signedIn = false;
    clearTimeout(state.timer);
    // Let a refresh under way finish first, so it is not refused half-way.
    await Promise.resolve(state.inflight).catch(() => {});
    try {
      await fetch('/session', { method: 'DELETE', credentials: 'same-origin' });
    } finally {
      showSignIn('');
    }
  });

  (async () => {
    try {
      const res = await fetch('/session', { credentials: 'same-origin', headers: { Accept: 'application/json' } });
      const info = await res.json();
      if (info.signed_in) signedIn(info);
      else showSignIn('');
    } catch (e) {
      showSignIn('kettle serve is not reachable.');
    }
  })();
})();
