//go:build linux && !race

package mqttapi

import (
	"syscall"
	"unsafe"
)

// rawRead and rawWrite are one read(2) or write(2) on a non-blocking
// socket, made without the scheduler's syscall bookkeeping (RawSyscall):
// neither blocks, and that bookkeeping — leaving and retaking the P, and
// waking the runtime's monitor thread whenever the process had gone idle —
// costs futex and nanosleep calls of its own on every packet, which on a
// virtual machine cost about as much as the read or write.
func rawRead(fd uintptr, b []byte) (int, syscall.Errno) {
	n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(n), e
}

func rawWrite(fd uintptr, b []byte) (int, syscall.Errno) {
	n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(n), e
}
