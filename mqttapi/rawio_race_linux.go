//go:build linux && race

package mqttapi

import "syscall"

// Under the race detector rawRead and rawWrite are syscall.Read and Write:
// those tell the detector that what one end of a socket writes happens
// before the other end reads it, which a bare RawSyscall does not.
func rawRead(fd uintptr, b []byte) (int, syscall.Errno) { return errno(syscall.Read(int(fd), b)) }

func rawWrite(fd uintptr, b []byte) (int, syscall.Errno) { return errno(syscall.Write(int(fd), b)) }

func errno(n int, err error) (int, syscall.Errno) {
	if err != nil {
		return -1, err.(syscall.Errno)
	}
	return n, 0
}
