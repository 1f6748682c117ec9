//go:build linux && race

package rawio

import "syscall"

// Enabled: Read and Write are real system calls here.
const Enabled = true

// Under the race detector Read and Write are syscall.Read and Write: those
// tell the detector that what one end of a socket writes happens before
// the other end reads it, which a bare RawSyscall does not (the detector
// would report a test's setup and its server's handler as racing).

// Read is one read(2) of fd into b; 0 when it succeeded.
func Read(fd uintptr, b []byte) (int, syscall.Errno) { return errno(syscall.Read(int(fd), b)) }

// Write is one write(2) of b to fd; 0 when it succeeded.
func Write(fd uintptr, b []byte) (int, syscall.Errno) { return errno(syscall.Write(int(fd), b)) }

func errno(n int, err error) (int, syscall.Errno) {
	if err != nil {
		return 0, err.(syscall.Errno)
	}
	return n, 0
}
