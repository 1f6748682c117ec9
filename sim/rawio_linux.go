//go:build linux && !race

package sim

import (
	"syscall"
	"unsafe"
)

// rawIO: reads and writes on plain TCP connections go through rawRead and
// rawWrite.
const rawIO = true

// rawWrite and rawRead are one write(2) or read(2) on a non-blocking
// socket, made without the scheduler's syscall bookkeeping (RawSyscall):
// neither blocks, and that bookkeeping — leaving and retaking the P, and
// waking the runtime's sysmon thread whenever the process had gone idle —
// costs futex and nanosleep calls of its own on every request, which on a
// virtual machine cost about as much as the read or write.
func rawWrite(fd uintptr, b []byte) (int, error) { return rawRW(syscall.SYS_WRITE, fd, b) }

func rawRead(fd uintptr, b []byte) (int, error) { return rawRW(syscall.SYS_READ, fd, b) }

func rawRW(trap, fd uintptr, b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	n, _, e := syscall.RawSyscall(trap, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}
