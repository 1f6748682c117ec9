// kettlefleet live view (kettle swarm --ui): the report page fed by the
// run's server-sent events — a tick a second with its newest seconds,
// merged into the page's data by their time, then the end with the final
// summary. Loaded after report.js, whose window.kettleReport it drives.
(function () {
  'use strict';
  const R = window.kettleReport;
  const $ = id => document.getElementById(id);
  let state = 'connecting';
  window.liveUpdates = 0;
  window.liveState = state;

  // Until the run ends the verdict, the totals and the USE table are not
  // the run's: hidden, and filled in from the final summary.
  const finals = [document.querySelector('main > .kpis'), $('use'), $('verdict')];
  for (const e of finals) if (e) e.style.display = 'none';
  // Nor is the verdict's time, which the charts would mark.
  R.data().verdict = undefined;
  R.update(R.data());

  function setState(s) {
    state = s;
    window.liveState = s;
    $('live-state').textContent = s;
    $('live-stop').disabled = s !== 'running';
  }

  // merge puts the window's seconds (src, with its own t) into dst by time:
  // a second seen before is overwritten (its system sample may have come
  // late), a new one appended; series dst lacks start out null.
  function merge(dst, src) {
    dst.t = dst.t || [];
    const pos = src.t.map(t => {
      let i = dst.t.length - 1;
      while (i >= 0 && dst.t[i] > t) i--;
      if (i >= 0 && dst.t[i] === t) return i;
      dst.t.push(t);
      return dst.t.length - 1;
    });
    const n = dst.t.length;
    (function walk(d, s) {
      for (const k in s) {
        const v = s[k];
        if (Array.isArray(v)) {
          const a = Array.isArray(d[k]) ? d[k] : (d[k] = []);
          while (a.length < n) a.push(null);
          v.forEach((x, i) => { a[pos[i]] = x; });
        } else if (v && typeof v === 'object') {
          walk(d[k] && typeof d[k] === 'object' ? d[k] : (d[k] = {}), v);
        }
      }
    })(dst, Object.assign({}, src, {t: undefined}));
    (function pad(d) {
      for (const k in d) {
        if (k === 't') continue;
        if (Array.isArray(d[k])) while (d[k].length < n) d[k].push(null);
        else if (d[k] && typeof d[k] === 'object') pad(d[k]);
      }
    })(dst);
  }

  const last = a => { for (let i = (a || []).length - 1; i >= 0; i--) if (a[i] !== null) return a[i]; return null; };
  const sum = a => (a || []).reduce((x, y) => x + (y || 0), 0);
  const num = v => v === null || v === undefined ? '–' : v >= 100 ? Math.round(v).toLocaleString('en') : (+v.toFixed(1)).toString();

  function kpi(big, small) {
    const d = document.createElement('div');
    d.className = 'kpi';
    const b = document.createElement('b'); b.textContent = big;
    const s = document.createElement('span'); s.textContent = small;
    d.append(b, s);
    return d;
  }

  // progress shows where the run stands, from the series the page holds.
  function progress(D) {
    const S = D.series || {}, p = D.params || {}, t = last(S.t) || 0;
    const dur = p.duration_s || 0;
    $('live-bar').style.width = (dur ? Math.min(100, 100 * t / dur) : 0) + '%';
    const kettles = last(S.kettles);
    $('live-line').textContent = `t = ${t} s of ${dur} s · ${num(kettles)} of ${num(p.devices)} kettles` +
      (p.scenario ? ` · scenario ${p.scenario}` : '') + (p.stages ? ` · ${p.stages.length} stages` : '');
    const box = $('live-kpis');
    box.textContent = '';
    let req = 0;
    for (const ep of Object.keys(S.endpoints || {}).sort()) {
      const e = S.endpoints[ep];
      req += sum(e.completed);
      box.appendChild(kpi(num(last(e.latency_ms && e.latency_ms.p99)) + ' ms',
        `${ep} p99 · ${num(last(e.completed))} of ${num(last(e.offered))} offered req/s`));
    }
    let errs = 0;
    for (const k in S.error_kinds || {}) errs += sum(S.error_kinds[k]);
    box.appendChild(kpi(num(errs), `errors of ${num(req)} requests`));
    const cpu = S.cpu || {};
    const pct = r => cpu[r] ? num(last(cpu[r])) + ' %' : 'not sampled';
    box.appendChild(kpi(pct('machine'), 'machine CPU busy (100 % = one core)'));
    box.appendChild(kpi(pct('server'), 'server CPU'));
    if (cpu.simulator) box.appendChild(kpi(pct('simulator'), 'simulator CPU'));
  }

  function showFinal(s, report, error) {
    if (s) {
      R.update(s);
      const v = $('verdict');
      $('verdict-text').textContent = s.verdict.text;
      v.querySelector('.cls').textContent = s.verdict.class;
      v.classList.toggle('none', s.verdict.class === 'none');
      const use = $('use') && $('use').querySelector('table');
      if (use) {
        while (use.rows.length > 1) use.deleteRow(1);
        for (const u of s.use || []) {
          const tr = use.insertRow();
          if (u.saturated) tr.classList.add('sat');
          if (u.verdict) tr.classList.add('blame');
          for (const c of [u.resource, u.utilisation, u.saturation, u.errors, u.saturated ? 't=' + u.saturated + 's' : '—']) tr.insertCell().textContent = c;
        }
      }
      const k = finals[0];
      if (k) {
        k.textContent = '';
        for (const ep of Object.keys(s.totals || {}).sort()) {
          const e = s.totals[ep];
          k.appendChild(kpi(num(e.p99_ms) + ' ms', `${ep} p99 · p50 ${num(e.p50_ms)} ms · ${num(e.per_second)} req/s`));
        }
        k.appendChild(kpi(num(s.errors), `errors of ${num(s.requests)} requests`));
        if (s.audit) k.appendChild(kpi(s.audit.lost || s.audit.duplicated ? `lost ${s.audit.lost} dup ${s.audit.duplicated}` : 'clean', `audit: acked ${s.audit.acked}, stored ${s.audit.stored}`));
      }
      for (const e of finals) if (e) e.style.display = '';
      progress(s);
    }
    $('live-line').textContent += (report ? ' · report: ' + report : '') + (error ? ' · ' + error : '');
  }

  $('live-stop').addEventListener('click', () => {
    $('live-stop').disabled = true;
    fetch('stop', {method: 'POST', headers: {'X-Kettle-Stop': '1'}, credentials: 'same-origin'})
      .then(r => { if (r.ok) setState('stopping'); else r.text().then(t => { $('live-line').textContent = 'stop refused: ' + t; }); });
  });

  const es = new EventSource('events');
  es.addEventListener('state', ev => setState(JSON.parse(ev.data).state));
  es.addEventListener('tick', ev => {
    const m = JSON.parse(ev.data), D = R.data();
    D.series = D.series || {};
    const have = D.series.t || [];
    if (have.length && m.series.t.length && m.series.t[0] > have[have.length - 1] + 1) {
      location.reload(); // missed seconds (the stream dropped): start over from the page
      return;
    }
    merge(D.series, m.series);
    R.update(D);
    if (m.state !== state) setState(m.state);
    progress(D);
    window.liveUpdates++;
  });
  es.addEventListener('end', ev => {
    es.close();
    const m = JSON.parse(ev.data);
    setState('ended');
    showFinal(m.summary, m.report, m.error);
  });
  es.onerror = () => {
    if (state !== 'ended') $('live-state').textContent = state + ' (reconnecting)';
  };
  progress(R.data());
})();
