package postgres

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kettlefleet/kettlefleet/internal/durable"
	"github.com/kettlefleet/kettlefleet/internal/pgbin"
	"github.com/kettlefleet/kettlefleet/internal/redact"
)

// BackupInfo is what a backup archive holds.
type BackupInfo struct {
	Bytes        int64 // the archive's size
	Measurements int64 // statistic 1 at the backup's snapshot
	Devices      int64 // registered kettles at that snapshot
	Tables       int   // tables whose data the archive holds (partitions included)
}

// Backup writes a pg_dump archive (custom format) of the kettle database at
// dsn to out, a file that must not exist yet, while servers go on writing
// to the database.
//
// pg_dump dumps the snapshot of a transaction Backup holds open (exported
// with pg_export_snapshot, passed as --snapshot), so Backup knows what the
// archive holds: the statistics' count and the registered kettles at that
// snapshot, every reading acknowledged before Backup started. The archive
// streams through Backup, which fsyncs it every 8 MiB (one fsync of a whole
// archive at the end holds up every other fsync on the machine, a server's
// commits included, until the disk's cache is flushed), then checks it with
// pg_restore --list and only then renames it from out.partial to out. The
// password is passed to pg_dump in its environment, not its arguments.
// progress, if not nil, is called as the archive grows with its bytes so
// far (and −1: the total is not known).
func Backup(ctx context.Context, dsn, out string, progress func(done, total int64)) (BackupInfo, error) {
	pgDump, err := clientTool("pg_dump")
	if err != nil {
		return BackupInfo{}, err
	}
	// Connected first: a backup that cannot reach its database leaves
	// nothing behind, not even the directory it would have written to.
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return BackupInfo{}, fmt.Errorf("back up %s: %w", redact.DSN(dsn), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	tmp, err := durable.NewFile(out)
	if err != nil {
		return BackupInfo{}, fmt.Errorf("back up to %s", err)
	}
	var info BackupInfo
	var snapshot string
	err = func() error {
		if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"); err != nil {
			return err
		}
		if err := conn.QueryRow(ctx, "SELECT pg_export_snapshot()").Scan(&snapshot); err != nil {
			return err
		}
		var kettle bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass('totals') IS NOT NULL AND to_regclass('devices') IS NOT NULL").Scan(&kettle); err != nil || !kettle {
			return cmp.Or(err, errors.New("not a kettle database (no totals and devices tables)"))
		}
		return conn.QueryRow(ctx, "SELECT coalesce(sum(measurements), 0)::int8, coalesce(sum(devices), 0)::int8 FROM totals").Scan(&info.Measurements, &info.Devices)
	}()
	if err != nil {
		return BackupInfo{}, fmt.Errorf("back up %s: %w", redact.DSN(dsn), err)
	}
	if info.Bytes, err = dumpTo(ctx, pgDump, dsn, snapshot, tmp, progress); err != nil {
		os.Remove(tmp)
		return BackupInfo{}, fmt.Errorf("back up %s: %w", redact.DSN(dsn), err)
	}
	conn.Exec(ctx, "COMMIT")
	if info.Tables, err = archiveTables(ctx, tmp); err != nil {
		os.Remove(tmp)
		return BackupInfo{}, fmt.Errorf("back up %s: the archive failed its check: %w", redact.DSN(dsn), err)
	}
	if err := durable.Publish(tmp, out); err != nil {
		return BackupInfo{}, fmt.Errorf("back up to %s: %w", out, err)
	}
	return info, nil
}

// dumpTo runs pg_dump of snapshot into the file tmp, fsynced every
// syncEvery bytes and at the end, and returns its size.
func dumpTo(ctx context.Context, pgDump, dsn, snapshot, tmp string, progress func(done, total int64)) (int64, error) {
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	arg, env := withoutPassword(dsn)
	cmd := exec.CommandContext(ctx, pgDump, "--format=custom", "--no-password", "--snapshot="+snapshot, arg)
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("pg_dump: %w", err)
	}
	w := &syncingWriter{f: f, progress: progress}
	if _, err := io.Copy(w, stdout); err != nil {
		// The disk is full, say: pg_dump, blocked on the pipe, would never
		// end by itself.
		cmd.Process.Kill()
		cmd.Wait()
		return 0, err // "write PATH: no space left on device"
	}
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("pg_dump: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return w.n, nil
}

// syncEvery is how many bytes of an archive are written between fsyncs.
const syncEvery = 8 << 20

// syncingWriter writes to f and fsyncs it every syncEvery bytes, then
// reports progress.
type syncingWriter struct {
	f        *os.File
	n, dirty int64
	progress func(done, total int64)
}

func (w *syncingWriter) Write(p []byte) (int, error) {
	n, err := w.f.Write(p)
	w.n += int64(n)
	w.dirty += int64(n)
	if err == nil && w.dirty >= syncEvery {
		err = w.f.Sync()
		w.dirty = 0
		if err == nil && w.progress != nil {
			w.progress(w.n, -1)
		}
	}
	return n, err
}

// archiveTables checks an archive with pg_restore --list and returns how
// many tables' data it holds; an archive without the devices table's data
// is not a kettle backup.
func archiveTables(ctx context.Context, archive string) (int, error) {
	pgRestore, err := clientTool("pg_restore")
	if err != nil {
		return 0, err
	}
	out, err := exec.CommandContext(ctx, pgRestore, "--list", archive).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pg_restore --list %s: %w: %s", archive, err, strings.TrimSpace(string(out)))
	}
	tables, devices := 0, false
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// "3391; 0 16423 TABLE DATA public devices kettle"
		for i := 0; i+3 < len(f); i++ {
			if f[i] == "TABLE" && f[i+1] == "DATA" {
				tables++
				devices = devices || f[i+3] == "devices"
				break
			}
		}
	}
	if !devices {
		return 0, fmt.Errorf("%s holds no data of a devices table: not a kettle backup", archive)
	}
	return tables, nil
}

// Restore loads a Backup archive into the empty database at dsn (create it
// first: createdb), in one transaction (pg_restore --single-transaction
// --exit-on-error: all or nothing), and returns what the database then
// holds. It refuses a database that has tables: a restore never overwrites
// a database that servers may be using.
func Restore(ctx context.Context, from, dsn string) (BackupInfo, error) {
	tables, err := archiveTables(ctx, from)
	if err != nil {
		return BackupInfo{}, fmt.Errorf("restore from %s: %w", from, err)
	}
	pgRestore, err := clientTool("pg_restore")
	if err != nil {
		return BackupInfo{}, err
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return BackupInfo{}, fmt.Errorf("restore to %s: %w", redact.DSN(dsn), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')").Scan(&n); err != nil {
		return BackupInfo{}, fmt.Errorf("restore to %s: %w", redact.DSN(dsn), err)
	}
	if n > 0 {
		return BackupInfo{}, fmt.Errorf("restore to %s: the database has %d tables; restore into an empty database (createdb NAME, then --db naming it), never over one servers may use", redact.DSN(dsn), n)
	}
	arg, env := withoutPassword(dsn)
	cmd := exec.CommandContext(ctx, pgRestore, "--exit-on-error", "--single-transaction", "--no-owner", "--no-password", "--dbname="+arg, from)
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		return BackupInfo{}, fmt.Errorf("pg_restore %s: %w: %s", from, err, strings.TrimSpace(string(out)))
	}
	info := BackupInfo{Tables: tables}
	if st, err := os.Stat(from); err == nil {
		info.Bytes = st.Size()
	}
	if err := conn.QueryRow(ctx, "SELECT coalesce(sum(measurements), 0)::int8, coalesce(sum(devices), 0)::int8 FROM totals").Scan(&info.Measurements, &info.Devices); err != nil {
		return BackupInfo{}, fmt.Errorf("restore to %s: read the totals: %w", redact.DSN(dsn), err)
	}
	return info, nil
}

// clientTool finds a PostgreSQL client program: on PATH, else the newest
// /usr/lib/postgresql/N/bin (Debian puts them there). pg_dump must be at
// least as new as the server; the newest installed is the best guess.
func clientTool(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range pgbin.Dirs() {
		if p := filepath.Join(d, name); isFile(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH or in /usr/lib/postgresql/*/bin: install the PostgreSQL client (apt-get install -y postgresql-client)", name)
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

var kvPassword = regexp.MustCompile(`(^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S*)\s*`)

// withoutPassword returns dsn without its password, and the environment
// for a libpq client with the password in PGPASSWORD: another user's ps
// shows a program's arguments.
func withoutPassword(dsn string) (string, []string) {
	env := os.Environ()
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil || cfg.Password == "" {
		return dsn, env
	}
	env = append(env, "PGPASSWORD="+cfg.Password)
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		if u.User != nil {
			u.User = url.User(u.User.Username())
		}
		q := u.Query()
		q.Del("password")
		u.RawQuery = q.Encode()
		return u.String(), env
	}
	return strings.TrimSpace(kvPassword.ReplaceAllString(dsn, "$1")), env
}
