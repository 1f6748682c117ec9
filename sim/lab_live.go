package sim

// emitSeconds hands Config.OnSecond each merged second of the fleet once
// every worker still running has reported it (a lost worker's seconds stop
// where it was lost; a finished one's are all in): the live view of a run
// over workers sees the same per-second series the results will hold.
func (l *lab) emitSeconds(final bool) {
	if l.cfg.OnSecond == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	upTo, found := 0, false
	for _, w := range l.ws {
		if w.state == stateRunning && !final {
			if !found || w.lastT < upTo {
				upTo = w.lastT
			}
			found = true
		}
	}
	if !found {
		for _, w := range l.ws {
			upTo = max(upTo, w.lastT)
		}
	}
	for t := l.emitted + 1; t <= upTo; t++ {
		var secs []Second
		for _, w := range l.ws {
			for j := len(w.seconds) - 1; j >= 0 && w.seconds[j].T >= t; j-- {
				if w.seconds[j].T == t {
					secs = append(secs, w.seconds[j])
					break
				}
			}
		}
		if len(secs) > 0 {
			l.cfg.OnSecond(mergeSecond(t, secs))
		}
	}
	l.emitted = max(l.emitted, upTo)
}
