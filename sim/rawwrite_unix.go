//go:build unix

package sim

import "syscall"

// rawWrite is one write(2) on a non-blocking socket.
func rawWrite(fd uintptr, b []byte) (int, error) {
	n, err := syscall.Write(int(fd), b)
	if n < 0 {
		n = 0
	}
	return n, err
}
