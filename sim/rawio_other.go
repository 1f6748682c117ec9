//go:build !linux

package sim

import "syscall"

// rawIO: elsewhere plain TCP connections are read and written through
// net.Conn.
const rawIO = false

// rawWrite: every write would block (EAGAIN), so each goes to the flusher,
// which writes with a deadline.
func rawWrite(fd uintptr, b []byte) (int, error) { return 0, syscall.EAGAIN }

// rawRead is not used (rawIO is false).
func rawRead(fd uintptr, b []byte) (int, error) { return 0, syscall.EAGAIN }
