//go:build linux && !race

// Package rawio reads and writes non-blocking sockets with one system call
// each, made without the Go scheduler's syscall bookkeeping (RawSyscall).
// Neither call blocks, and that bookkeeping — leaving and retaking the P,
// and waking the runtime's sysmon thread whenever the process had gone
// idle — costs futex and nanosleep calls of its own on every request,
// which on a virtual machine cost about as much as the read or write.
// Callers make the calls inside syscall.RawConn's callbacks, so the
// runtime's poller still does the waiting and the deadlines.
package rawio

import (
	"syscall"
	"unsafe"
)

// Enabled: Read and Write are real system calls here.
const Enabled = true

// Read is one read(2) of fd into b; 0 when it succeeded.
func Read(fd uintptr, b []byte) (int, syscall.Errno) { return rw(syscall.SYS_READ, fd, b) }

// Write is one write(2) of b to fd; 0 when it succeeded.
func Write(fd uintptr, b []byte) (int, syscall.Errno) { return rw(syscall.SYS_WRITE, fd, b) }

func rw(trap, fd uintptr, b []byte) (int, syscall.Errno) {
	if len(b) == 0 {
		return 0, 0
	}
	n, _, e := syscall.RawSyscall(trap, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), 0
}
