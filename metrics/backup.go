package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Backup is what a successful kettle backup reports.
type Backup struct {
	At           time.Time     // when it finished
	Took         time.Duration // how long it ran
	Bytes        int64         // the backup file's size
	Measurements int64         // the readings it holds
}

// WriteBackupFile writes b as kettle_backup_* gauges to path in the
// Prometheus text format, for node_exporter's textfile collector (which
// reads the *.prom files of its --collector.textfile.directory). kettle
// backup is a command that ends, not a server to scrape: the file holds
// its last success, which the KettleBackupStale alert watches. The file is
// replaced whole (written beside it, then renamed), so a scrape never reads
// half of it.
func WriteBackupFile(path string, b Backup) error {
	reg := prometheus.NewRegistry()
	gauge := func(name, help string, v float64) {
		g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
		g.Set(v)
		reg.MustRegister(g)
	}
	gauge("kettle_backup_last_success_timestamp_seconds", "When the last successful kettle backup finished (unix time).", float64(b.At.UnixMilli())/1e3)
	gauge("kettle_backup_last_duration_seconds", "How long the last successful kettle backup ran.", b.Took.Seconds())
	gauge("kettle_backup_last_size_bytes", "The size of the last successful kettle backup's file.", float64(b.Bytes))
	gauge("kettle_backup_last_measurements", "Readings held by the last successful kettle backup.", float64(b.Measurements))
	return prometheus.WriteToTextfile(path, reg)
}
