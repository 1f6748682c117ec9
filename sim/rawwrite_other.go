//go:build !unix

package sim

import "syscall"

// rawWrite: elsewhere every write would block (EAGAIN), so each goes to the
// flusher, which writes with a deadline.
func rawWrite(fd uintptr, b []byte) (int, error) { return 0, syscall.EAGAIN }
