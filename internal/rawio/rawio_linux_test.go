package rawio

import (
	"bytes"
	"math/rand/v2"
	"syscall"
	"testing"
)

// socketpair is two connected non-blocking stream sockets, as the callers'
// sockets are (the runtime's poller sets O_NONBLOCK on every net.Conn).
func socketpair(t *testing.T) (a, b uintptr) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fds[0]); syscall.Close(fds[1]) })
	return uintptr(fds[0]), uintptr(fds[1])
}

// TestReadWrite: Read and Write (the RawSyscall path without -race, the
// syscall.Read/Write path under it: `make test` runs both) move exactly
// the bytes they say, report EAGAIN where a non-blocking socket would
// block, 0 bytes at the peer's end, and the kernel's errno otherwise.
func TestReadWrite(t *testing.T) {
	if !Enabled {
		t.Fatal("Enabled is false on Linux")
	}
	a, b := socketpair(t)
	buf := make([]byte, 64)

	if n, e := Read(b, buf); n != 0 || e != syscall.EAGAIN {
		t.Errorf("read of an empty socket: %d, %v; want 0, EAGAIN", n, e)
	}
	if n, e := Write(a, nil); n != 0 || e != 0 {
		t.Errorf("write of nothing: %d, %v; want 0, 0", n, e)
	}
	if n, e := Read(b, nil); n != 0 || e != 0 {
		t.Errorf("read into nothing: %d, %v; want 0, 0", n, e)
	}

	msg := []byte("water_level_ml=950")
	if n, e := Write(a, msg); n != len(msg) || e != 0 {
		t.Fatalf("write %q: %d, %v; want %d, 0", msg, n, e, len(msg))
	}
	// A buffer shorter than what is there: filled, the rest left.
	if n, e := Read(b, buf[:5]); n != 5 || e != 0 || string(buf[:5]) != "water" {
		t.Errorf("read of 5: %d, %v, %q; want 5, 0, \"water\"", n, e, buf[:5])
	}
	if n, e := Read(b, buf); n != len(msg)-5 || e != 0 || string(buf[:n]) != string(msg[5:]) {
		t.Errorf("read of the rest: %d, %v, %q; want %d, 0, %q", n, e, buf[:max(n, 0)], len(msg)-5, msg[5:])
	}

	// Write until the socket's buffer is full: a short write or EAGAIN,
	// never more than given; then everything written reads back in order.
	rng := rand.New(rand.NewPCG(1, 2))
	var sent []byte
	chunk := make([]byte, 7919) // prime: the buffer does not fill on a chunk's edge
	for full := false; !full; {
		for i := range chunk {
			chunk[i] = byte(rng.Uint32())
		}
		n, e := Write(a, chunk)
		switch {
		case e == syscall.EAGAIN:
			if n != 0 {
				t.Fatalf("EAGAIN with %d bytes written", n)
			}
			full = true
		case e != 0:
			t.Fatalf("write: %v", e)
		case n <= 0 || n > len(chunk):
			t.Fatalf("write of %d bytes: %d", len(chunk), n)
		default:
			sent = append(sent, chunk[:n]...)
			full = n < len(chunk)
		}
	}
	var got []byte
	big := make([]byte, 4096)
	for len(got) < len(sent) {
		n, e := Read(b, big)
		if e != 0 || n <= 0 || n > len(big) {
			t.Fatalf("read after %d of %d bytes: %d, %v", len(got), len(sent), n, e)
		}
		got = append(got, big[:n]...)
	}
	if !bytes.Equal(got, sent) {
		t.Fatalf("%d bytes read back differ from the %d written", len(got), len(sent))
	}
	if n, e := Read(b, big); n != 0 || e != syscall.EAGAIN {
		t.Errorf("read of a drained socket: %d, %v; want 0, EAGAIN", n, e)
	}

	// The peer gone: reading says 0 bytes and no error (end of stream);
	// writing says EPIPE (the runtime ignores the SIGPIPE that comes with
	// it on descriptors other than 1 and 2).
	if err := syscall.Shutdown(int(a), syscall.SHUT_RDWR); err != nil {
		t.Fatal(err)
	}
	if n, e := Read(b, buf); n != 0 || e != 0 {
		t.Errorf("read after the peer closed: %d, %v; want 0, 0", n, e)
	}
	if n, e := Write(b, msg); n != 0 || e != syscall.EPIPE {
		t.Errorf("write after the peer closed: %d, %v; want 0, EPIPE", n, e)
	}
	if n, e := Read(^uintptr(0)>>1, buf); n != 0 || e != syscall.EBADF {
		t.Errorf("read of a bad descriptor: %d, %v; want 0, EBADF", n, e)
	}
}
