// Package durable holds the file-system steps that make a new file's name
// survive a crash.
package durable

import "os"

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
