// kettlefleet report: hand-written SVG line charts over the summary JSON
// embedded in the page. No network, no libraries.
(function () {
  'use strict';
  // D is the summary; the live view (live.js) replaces it and calls
  // window.kettleReport.update as the run goes.
  let D = JSON.parse(document.getElementById('report-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const COLORS = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#4b5563', '#65a30d', '#ea580c'];
  const charts = []; // {el, spec} for redraws
  let S = {}, T = [];

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return '–';
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + 'M';
    if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + 'k';
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    if (a === 0) return '0';
    return v.toPrecision(2);
  }
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toFixed(10));
    return {ticks, step, hi: Math.ceil(hi / step) * step};
  }
  function clock(t) {
    if (!D.start) return t + 's';
    const d = new Date(new Date(D.start).getTime() + t * 1000);
    return d.toISOString().substr(11, 8);
  }

  // spec: {x:[], xLabel(x), series:[{name, y:[], color, dash}], hlines:[{y, label, color}], vline:x, unit, yMinMax, points}
  function draw(fig, spec) {
    const plot = fig.querySelector('.plot');
    plot.textContent = '';
    const W = Math.max(plot.clientWidth, 300), H = Math.max(plot.clientHeight, 150);
    const svg = el('svg', {viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': fig.querySelector('figcaption').textContent}, plot);
    const series = (spec.series || []).filter(s => s.y && s.y.some(v => v !== null && isFinite(v)));
    const legend = fig.querySelector('.legend');
    legend.textContent = '';
    if (!series.length || !spec.x.length) {
      const t = el('text', {x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'nodata'}, svg);
      t.textContent = spec.empty || 'no data in this run';
      fig.dataset.drawn = 'nodata';
      return;
    }
    const m = {l: 52, r: 12, t: 10, b: 24};
    const xs = spec.x, x0 = xs[0], x1 = xs[xs.length - 1] === x0 ? x0 + 1 : xs[xs.length - 1];
    let ymax = 0;
    for (const s of series) for (const v of s.y) if (v !== null && isFinite(v) && v > ymax) ymax = v;
    for (const h of spec.hlines || []) if (h.y > ymax && h.y < ymax * 4) ymax = h.y;
    if (spec.yMin !== undefined && ymax < spec.yMin) ymax = spec.yMin;
    const yt = niceTicks(0, ymax * 1.05 || 1, 5);
    const X = v => m.l + (v - x0) / (x1 - x0) * (W - m.l - m.r);
    const Y = v => H - m.b - v / yt.hi * (H - m.t - m.b);
    const g = el('g', {class: 'grid'}, svg), ax = el('g', {class: 'axis'}, svg);
    for (const v of yt.ticks) {
      el('line', {x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v)}, g);
      const t = el('text', {x: m.l - 6, y: Y(v) + 4, 'text-anchor': 'end'}, ax);
      t.textContent = fmt(v);
    }
    const xt = niceTicks(x0, x1, Math.max(2, Math.floor((W - m.l) / 90)));
    for (const v of xt.ticks) {
      if (v < x0 || v > x1) continue;
      const t = el('text', {x: X(v), y: H - 6, 'text-anchor': X(v) > W - m.r - 24 ? 'end' : 'middle'}, ax);
      t.textContent = (spec.xLabel || (x => x + 's'))(v);
    }
    el('path', {d: `M${m.l},${m.t}V${H - m.b}H${W - m.r}`, fill: 'none'}, ax);
    // Bands over the time series, each labelled: the faults (chaos
    // nemesis) and the load shape's stages (params.stages, the rollout).
    if (spec.x === T) [[D.faults, 'band'], [D.stages, 'band stage']].forEach(([list, cls]) => (list || []).forEach((b, k) => {
      const a = Math.max(b.t0, x0), z = Math.min(Math.max(b.t1, b.t0 + 1), x1);
      if (!(z > a)) return;
      const r = el('rect', {x: X(a), y: m.t, width: Math.max(X(z) - X(a), 1), height: H - m.t - m.b, class: cls}, svg);
      el('title', {}, r).textContent = b.name + ' (' + clock(b.t0) + '–' + clock(b.t1) + ')';
      const t = el('text', {x: X(a) + 2, y: m.t + 10 + 11 * (k % 3), class: cls}, svg);
      t.textContent = b.kind;
    }));
    for (const h of spec.hlines || []) {
      if (!(h.y <= yt.hi)) continue;
      el('line', {x1: m.l, x2: W - m.r, y1: Y(h.y), y2: Y(h.y), class: 'hline', stroke: h.color || '#b42318'}, svg);
      const t = el('text', {x: W - m.r - 4, y: Y(h.y) - 4, 'text-anchor': 'end', class: 'mark', fill: h.color || '#b42318'}, svg);
      t.textContent = h.label;
    }
    if (spec.vline !== undefined && spec.vline >= x0 && spec.vline <= x1) {
      el('line', {x1: X(spec.vline), x2: X(spec.vline), y1: m.t, y2: H - m.b, class: 'vline'}, svg);
      const t = el('text', {x: X(spec.vline) + 4, y: m.t + 10, class: 'mark'}, svg);
      t.textContent = 'verdict';
    }
    series.forEach((s, k) => {
      const color = s.color || COLORS[k % COLORS.length];
      let d = '', pen = false;
      s.y.forEach((v, i) => {
        if (v === null || !isFinite(v) || i >= xs.length) { pen = false; return; }
        d += (pen ? 'L' : 'M') + X(xs[i]).toFixed(1) + ',' + Y(v).toFixed(1);
        pen = true;
      });
      const p = el('path', {d, class: 'line', stroke: color}, svg);
      if (s.dash) p.setAttribute('stroke-dasharray', '5 3');
      if (spec.points) s.y.forEach((v, i) => { if (v !== null && isFinite(v)) el('circle', {cx: X(xs[i]), cy: Y(v), r: 3.2, fill: color}, svg); });
      const li = document.createElement('span');
      const sw = document.createElement('i');
      sw.style.background = color; sw.style.color = color;
      if (s.dash) sw.className = 'dash';
      li.appendChild(sw);
      li.appendChild(document.createTextNode(s.name));
      legend.appendChild(li);
    });
    // Hover: the values at the nearest x.
    const tip = fig.querySelector('.tip');
    const cursor = el('line', {y1: m.t, y2: H - m.b, stroke: '#9aa3b2', visibility: 'hidden'}, svg);
    svg.addEventListener('mousemove', ev => {
      const r = svg.getBoundingClientRect();
      const px = (ev.clientX - r.left) * W / r.width;
      let best = 0;
      xs.forEach((v, i) => { if (Math.abs(X(v) - px) < Math.abs(X(xs[best]) - px)) best = i; });
      cursor.setAttribute('x1', X(xs[best])); cursor.setAttribute('x2', X(xs[best]));
      cursor.setAttribute('visibility', 'visible');
      tip.textContent = '';
      const head = document.createElement('div');
      head.textContent = (spec.xLabel || (x => 't=' + x + 's'))(xs[best]) + (spec.xLabel ? '' : '  ' + clock(xs[best]));
      tip.appendChild(head);
      for (const s of series) {
        const row = document.createElement('div');
        row.textContent = s.name + ': ' + fmt(s.y[best]) + (spec.unit ? ' ' + spec.unit : '');
        tip.appendChild(row);
      }
      tip.style.display = 'block';
      const left = (ev.clientX - r.left) + 14;
      tip.style.left = (left + tip.offsetWidth > r.width ? left - tip.offsetWidth - 28 : left) + 'px';
      tip.style.top = '28px';
    });
    svg.addEventListener('mouseleave', () => { tip.style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); });
    fig.dataset.drawn = 'lines';
  }

  function figure(id, title, parent) {
    const f = document.createElement('figure');
    f.className = 'chart';
    f.id = 'chart-' + id;
    const c = document.createElement('figcaption');
    c.textContent = title;
    f.appendChild(c);
    const p = document.createElement('div'); p.className = 'plot'; f.appendChild(p);
    const l = document.createElement('div'); l.className = 'legend'; f.appendChild(l);
    const t = document.createElement('div'); t.className = 'tip'; f.appendChild(t);
    parent.appendChild(f);
    return f;
  }
  function add(id, title, specFn, parent) {
    const f = figure(id, title, parent || document.getElementById('charts'));
    charts.push({f, specFn});
  }
  function redraw() { for (const c of charts) draw(c.f, c.specFn()); }

  // build makes every chart from D (again, when the live view updates it).
  function build() {
    charts.length = 0;
    for (const id of ['charts', 'capacity-charts']) { const c = document.getElementById(id); if (c) c.textContent = ''; }
    S = D.series || {};
    T = S.t || [];
    const vline = D.verdict && D.verdict.t ? D.verdict.t : undefined;
    const timeSpec = (series, extra) => Object.assign({x: T, series, vline}, extra || {});
    const names = o => Object.keys(o || {}).sort();
    const slo = D.params && D.params.slo_p99_ms ? [{y: D.params.slo_p99_ms, label: 'SLO p99 ' + D.params.slo_p99_ms + ' ms'}] : [];
    const selected = () => Array.from(document.querySelectorAll('#pct input:checked')).map(i => i.value);
    const PCOL = {'p50': '#2563eb', 'p95': '#059669', 'p99': '#d97706', 'p99.9': '#dc2626', 'max': '#6b7280'};

    // Capacity steps.
    if (D.capacity && D.capacity.steps && D.capacity.steps.length) {
      const st = D.capacity.steps, kx = st.map(s => s.kettles), parent = document.getElementById('capacity-charts');
      add('capacity-p99', 'Capacity: steady-state p99 by fleet size (ms)', () => ({
        x: kx, xLabel: fmt, points: true, unit: 'ms',
        series: [{name: 'p99 (worst endpoint)', y: st.map(s => s.p99_ms), color: '#d97706'}, {name: 'p50', y: st.map(s => s.p50_ms), color: '#2563eb'}],
        hlines: [{y: D.capacity.slo_p99_ms, label: 'SLO ' + D.capacity.slo_p99_ms + ' ms'}]}), parent);
      add('capacity-rate', 'Capacity: throughput and errors by fleet size', () => ({
        x: kx, xLabel: fmt, points: true,
        series: [{name: 'offered req/s', y: st.map(s => s.offered_per_s), dash: true, color: '#6b7280'},
          {name: 'completed req/s', y: st.map(s => s.completed_per_s), color: '#059669'},
          {name: 'errors per 1000 requests', y: st.map(s => s.error_rate * 1000), color: '#dc2626'}]}), parent);
    }

    for (const ep of names(S.endpoints)) {
      add('latency-' + ep, 'Latency: ' + ep + ' (ms, from the intended send time)', () => ({
        x: T, vline, unit: 'ms', hlines: slo,
        series: selected().map(p => ({name: p, y: S.endpoints[ep].latency_ms[p], color: PCOL[p]}))}));
    }
    add('throughput', 'Throughput: offered (dashed) vs completed (req/s)', () => timeSpec(
      names(S.endpoints).flatMap((ep, k) => [
        {name: ep + ' offered', y: S.endpoints[ep].offered, dash: true, color: COLORS[k]},
        {name: ep + ' completed', y: S.endpoints[ep].completed, color: COLORS[k]}]), {unit: 'req/s'}));
    add('status', 'Responses by status, errors by kind (per second)', () => timeSpec(
      names(S.status).map((c, k) => ({name: 'HTTP ' + c, y: S.status[c], color: c.startsWith('2') || c === '304' ? COLORS[[2, 5, 8][k % 3]] : COLORS[1 + (k % 3)]}))
        .concat(names(S.error_kinds).map((c, k) => ({name: c, y: S.error_kinds[c], dash: true, color: COLORS[(k + 3) % COLORS.length]})))));
    add('kettles', 'Active kettles and exchanges in flight', () => timeSpec([
      {name: 'kettles hatched', y: S.kettles, color: '#2563eb'}, {name: 'in flight', y: S.in_flight, color: '#d97706'}]));
    const roleColor = {server: '#2563eb', postgres: '#7c3aed', simulator: '#059669', machine: '#1f2937', other: '#9ca3af', iowait: '#d97706'};
    add('cpu', 'CPU by process (%, 100 = one core)', () => timeSpec(
      names(S.cpu).map(r => ({name: r === 'machine' ? 'machine busy' : r === 'other' ? 'other processes' : r, y: S.cpu[r], color: roleColor[r], dash: r === 'machine' || r === 'iowait'})),
      {unit: '%', hlines: [{y: 100 * (D.cpus || 1), label: 'machine: ' + 100 * (D.cpus || 1) + ' %', color: '#6b7280'}], empty: 'not sampled (results have no system section)'}));
    add('memory', 'Resident memory by process, and the server\'s live Go heap (MiB)', () => timeSpec(
      names(S.rss_mib).filter(r => r !== 'available').map(r => r === 'server live heap'
        ? {name: 'server live heap (after GC)', y: S.rss_mib[r], color: roleColor.server, dash: true}
        : {name: r, y: S.rss_mib[r], color: roleColor[r]}), {unit: 'MiB', empty: 'not sampled'}));
    add('disk', 'Disk await (ms per I/O)', () => timeSpec(
      names(S.disk_await_ms).map(d => ({name: d + ' await', y: S.disk_await_ms[d]})), {unit: 'ms', empty: 'no block device sampled'}));
    add('queue', 'Ingest queue depth (rows) and 503 refusals (readings/s)', () => {
      const q = S.queue || {};
      const cap = (q.capacity || []).find(v => v !== null);
      return timeSpec([{name: 'queue rows', y: q.rows, color: '#2563eb'}, {name: 'refused 503/s', y: q.rejected_per_s, color: '#dc2626'}, {name: 'commit ms (mean)', y: q.commit_ms, color: '#6b7280', dash: true}],
        {hlines: cap ? [{y: cap, label: 'capacity ' + fmt(cap) + ' rows', color: '#6b7280'}] : [], empty: 'not scraped (no server /metrics)'});
    });
    add('pool', 'DB pool: connections in use, requests waiting', () => {
      const p = S.pool || {};
      if (p.max) return timeSpec([{name: 'acquired', y: p.acquired, color: '#7c3aed'}, {name: 'waiting (acquire wait s/s)', y: p.wait, color: '#dc2626'}],
        {hlines: [{y: (p.max.find(v => v !== null) || 0), label: 'pool size', color: '#6b7280'}]});
      return timeSpec([{name: 'SQLite busy retries/s (no pool: SQLite store)', y: p.sqlite_busy_per_s, color: '#6b7280'}], {empty: 'no PostgreSQL pool in this run'});
    });
    if ((S.pool || {}).pg_fpi_per_s) add('wal', 'PostgreSQL: full-page images and WAL MiB written per second (images surge after a checkpoint begins)', () => timeSpec([
      {name: 'full-page images/s', y: S.pool.pg_fpi_per_s, color: '#7c3aed'},
      {name: 'WAL MiB/s', y: S.pool.pg_wal_mib_per_s, color: '#6b7280', dash: true},
      {name: 'checkpoints begun', y: S.pool.pg_checkpoints_per_s, color: '#dc2626'}]));
    if ((S.pool || {}).pg_checkpoint_buffers_per_s) add('ckptbuf', 'PostgreSQL: buffers checkpoints wrote per second (they stop for the sync phase, which fsyncs them all)', () => timeSpec([
      {name: 'checkpoint buffers/s', y: S.pool.pg_checkpoint_buffers_per_s, color: '#7c3aed'}]));
    if ((S.pool || {}).pg_wal_segments_ready) add('walseg', 'PostgreSQL: WAL segment files created per second (16 MiB zero-filled while commits wait) and ready ahead (recycled)', () => timeSpec([
      {name: 'new segment files/s', y: S.pool.pg_wal_segments_created_per_s, color: '#dc2626'},
      {name: 'segment files ready', y: S.pool.pg_wal_segments_ready, color: '#6b7280', dash: true}]));
    add('lag', 'Simulator: dispatch lag (ms) and late starts (per second)', () => timeSpec([
      {name: 'lag ms', y: S.lag_ms, color: '#dc2626'}, {name: 'late starts', y: S.late_starts, color: '#d97706', dash: true}],
    {hlines: [{y: 500, label: 'lag limit 500 ms', color: '#6b7280'}]}));
    add('pressure', 'Run queue and pressure stall (% of time some task waited)', () => timeSpec(
      [{name: 'run queue (procs running)', y: S.run_queue, color: '#1f2937'}].concat(names(S.psi).map((r, k) => ({name: 'PSI ' + r, y: S.psi[r], color: COLORS[k + 1], dash: true}))),
      {empty: 'not sampled'}));

    redraw();
    window.reportCharts = charts.length;
  }

  document.querySelectorAll('#pct input').forEach(i => i.addEventListener('change', redraw));
  let pending = 0;
  window.addEventListener('resize', () => { clearTimeout(pending); pending = setTimeout(redraw, 120); });
  build();
  window.kettleReport = {data: () => D, update(d) { D = d; build(); }};
})();
