//go:build linux && race

package sim

import "syscall"

// rawIO: reads and writes on plain TCP connections go through rawRead and
// rawWrite.
const rawIO = true

// Under the race detector rawRead and rawWrite are syscall.Read and Write:
// those tell the detector that what one end writes happens before the
// other end reads it, which a bare RawSyscall does not — the detector would
// see a test's setup and its fake server's handler as racing.
func rawWrite(fd uintptr, b []byte) (int, error) { return fixN(syscall.Write(int(fd), b)) }

func rawRead(fd uintptr, b []byte) (int, error) { return fixN(syscall.Read(int(fd), b)) }

func fixN(n int, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	return n, nil
}
