package main

import (
	"bufio"
	"io"
	"os"
	"sync"
	"time"
)

// logSink buffers log output and flushes it every 100 ms, so a line per
// request costs no syscall per request. Lines are written whole.
type logSink struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func newLogSink(w io.Writer) *logSink {
	s := &logSink{w: bufio.NewWriterSize(w, 64<<10)}
	go func() {
		for range time.Tick(100 * time.Millisecond) {
			s.mu.Lock()
			s.w.Flush()
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// Flush writes out what is buffered (at exit).
func (s *logSink) Flush() {
	s.mu.Lock()
	s.w.Flush()
	s.mu.Unlock()
}

// stderrSink is the process's buffered stderr log sink.
var stderrSink = sync.OnceValue(func() *logSink { return newLogSink(os.Stderr) })
