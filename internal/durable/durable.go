// Package durable holds the file-system steps that give a new file its
// name only once it is whole, and make that name survive a crash: what a
// backup needs.
package durable

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// NewFile prepares for writing the file out, which must not exist (a
// backup never overwrites): it creates out's directory and returns the
// name to write it under first, out + ".partial", removing one an
// interrupted run left.
func NewFile(out string) (tmp string, err error) {
	if _, err := os.Lstat(out); err == nil {
		return "", fmt.Errorf("%s: the file exists; name a new file (a backup never overwrites)", out)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s: %w", out, err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", fmt.Errorf("%s: create directory: %w", out, err)
	}
	tmp = out + ".partial"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s: remove a leftover: %w", out, err)
	}
	return tmp, nil
}

// Publish renames tmp, written and fsynced, to out and fsyncs the
// directory, so that the name survives a crash. On error tmp is removed.
func Publish(tmp, out string) error {
	if err := os.Rename(tmp, out); err != nil {
		os.Remove(tmp)
		return err
	}
	return SyncDir(filepath.Dir(out))
}

// SyncDir fsyncs the directory dir, making a file created or renamed in it
// durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
