//go:build !linux

// Package rawio reads and writes non-blocking sockets with one system call
// each on Linux; elsewhere callers use net.Conn (Enabled is false).
package rawio

import "syscall"

// Enabled: false, Read and Write always say EAGAIN.
const Enabled = false

// Read would block.
func Read(fd uintptr, b []byte) (int, syscall.Errno) { return 0, syscall.EAGAIN }

// Write would block: a caller hands the bytes to its blocking path.
func Write(fd uintptr, b []byte) (int, syscall.Errno) { return 0, syscall.EAGAIN }
