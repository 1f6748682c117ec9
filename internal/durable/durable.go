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
// name to write it under first, out + ".partial" (created empty, mode
// 0600), removing one an interrupted run left.
func NewFile(out string) (tmp string, err error) {
	if _, err := os.Lstat(out); err == nil {
		return "", fmt.Errorf("%s: the file exists; name a new file (a backup never overwrites)", out)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s: %w", out, err)
	}
	// A backup holds every kettle's readings and the v0 kettles' only
	// credential: readable by its owner only, in a directory of its owner's.
	if err := os.MkdirAll(filepath.Dir(out), 0o700); err != nil {
		return "", fmt.Errorf("%s: create directory: %w", out, err)
	}
	tmp = out + ".partial"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s: remove a leftover: %w", out, err)
	}
	// Created here, 0600, so that whatever writes it (SQLite's backup API
	// opens it by name) keeps that mode.
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return "", fmt.Errorf("%s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return "", err
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

// CreateSecret writes data to path, which must not exist, so that path
// either does not exist or holds all of data, even across a crash: a
// temporary file in the same directory (mode 0600), fsynced, then linked
// to path — the link fails if path appeared meanwhile (another process
// generating the same secret), and then that process's secret stands:
// fs.ErrExist is returned and the caller reads it. The directory is
// fsynced so the name survives.
func CreateSecret(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".new-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	// link(2) creates path only if it does not exist: O_EXCL for a name
	// that appears whole.
	if err := os.Link(tmp, path); err != nil {
		return err
	}
	return SyncDir(dir)
}
